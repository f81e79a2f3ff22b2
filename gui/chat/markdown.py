"""Answers as HTML for a QTextBrowser: Markdown, with each code block under a Copy link.

Raw HTML in an answer is shown as text, never interpreted. ``render`` returns the HTML and
the code blocks' texts; the link ``copy:N`` asks for block N.
"""

from __future__ import annotations

import html
from typing import Any

from markdown_it import MarkdownIt

CODE_BG = "#f3f4f6"
CODE_HEAD_BG = "#e5e7eb"


def _fence(blocks: list[str], first: int) -> Any:
    def render(renderer: Any, tokens: list[Any], idx: int, options: Any, env: Any) -> str:
        tok = tokens[idx]
        code = tok.content
        n = first + len(blocks)
        blocks.append(code.rstrip("\n"))
        lang = html.escape(tok.info.strip().split(" ")[0]) if tok.info else ""
        return (
            f'<table width="100%" cellspacing="0" cellpadding="6" bgcolor="{CODE_BG}">'
            f'<tr><td bgcolor="{CODE_HEAD_BG}"><small>{lang or "code"}</small> &nbsp; '
            f'<a href="copy:{n}">Copy</a></td></tr>'
            f"<tr><td><pre>{html.escape(code.rstrip(chr(10)))}</pre></td></tr></table>"
        )

    return render


def render(text: str, first: int = 0) -> tuple[str, list[str]]:
    """``text`` (Markdown) as HTML, and its code blocks in order (linked as ``copy:first``,
    ``copy:first+1`` ...: a transcript numbers the blocks of all its messages in one sequence)."""
    blocks: list[str] = []
    md = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")
    md.add_render_rule("fence", _fence(blocks, first))
    md.add_render_rule("code_block", _fence(blocks, first))
    return md.render(text), blocks
