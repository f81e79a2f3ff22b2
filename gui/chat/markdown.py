"""Answers as HTML for a QTextBrowser: Markdown, with each code block highlighted (Pygments)
under a Copy link, in the colours of a :class:`~gui.chat.theme.Theme`.

Raw HTML in an answer is shown as text, never interpreted. ``render`` returns the HTML and
the code blocks' texts; the link ``copy:N`` asks for block N.
"""

from __future__ import annotations

import functools
import html
from typing import Any

from markdown_it import MarkdownIt
from pygments.lexer import Lexer
from pygments.lexers import get_lexer_by_name
from pygments.styles import get_style_by_name
from pygments.util import ClassNotFound

from gui.chat.theme import Theme, readable


def _lexer(lang: str) -> Lexer | None:
    if not lang:
        return None
    try:
        lexer: Lexer = get_lexer_by_name(lang, stripnl=False, ensurenl=False)
    except ClassNotFound:  # a language Pygments does not know: the code stays plain
        return None
    return lexer


@functools.lru_cache(maxsize=256)
def highlight(code: str, lang: str, theme: Theme) -> str:
    """``code`` as HTML spans coloured by the Pygments style of ``theme`` (each colour moved
    until it reads on the code block's background); plain escaped text for an unknown ``lang``."""
    lexer = _lexer(lang)
    if lexer is None:
        return html.escape(code)
    try:
        style = get_style_by_name(theme.code_style)
    except ClassNotFound:  # (an older Pygments without it)
        style = get_style_by_name("monokai" if theme.dark else "default")
    out = []
    for kind, value in lexer.get_tokens(code):
        s = style.style_for_token(kind)
        css = [f"color:{readable('#' + s['color'], theme.code_bg)}"] if s["color"] else []
        css += ["font-weight:bold"] if s["bold"] else []
        css += ["font-style:italic"] if s["italic"] else []
        text = html.escape(value)
        out.append(f'<span style="{";".join(css)}">{text}</span>' if css else text)
    return "".join(out)


def _fence(blocks: list[str], first: int, theme: Theme) -> Any:
    def render(renderer: Any, tokens: list[Any], idx: int, options: Any, env: Any) -> str:
        tok = tokens[idx]
        code = tok.content.rstrip("\n")
        n = first + len(blocks)
        blocks.append(code)
        lang = tok.info.strip().split(" ")[0] if tok.info else ""
        return (
            f'<table width="100%" cellspacing="0" cellpadding="6" bgcolor="{theme.code_bg}">'
            f'<tr><td bgcolor="{theme.code_head_bg}"><small>{html.escape(lang) or "code"}</small> &nbsp; '
            f'<a href="copy:{n}" style="color:{theme.link}">Copy</a></td></tr>'
            f'<tr><td><pre style="color:{theme.text}">{highlight(code, lang, theme)}</pre></td></tr></table>'
        )

    return render


def render(text: str, theme: Theme, first: int = 0) -> tuple[str, list[str]]:
    """``text`` (Markdown) as HTML in ``theme``'s colours, and its code blocks in order (linked
    as ``copy:first``, ``copy:first+1`` ...: a transcript numbers the blocks of all its messages
    in one sequence)."""
    blocks: list[str] = []
    md = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")
    md.add_render_rule("fence", _fence(blocks, first, theme))
    md.add_render_rule("code_block", _fence(blocks, first, theme))
    return md.render(text), blocks
