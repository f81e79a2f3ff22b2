"""A conversation as the chat window shows it (pure): the questions, the answers rendered
from Markdown, and the small print under each answer (its figures, a note from the cluster
while it waits, and, in red with a Retry link, how it broke off)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from gui.chat.markdown import render
from gui.chat.store import Message


def answer_stats(stats: dict[str, Any], names: dict[str, str]) -> str:
    """The line under an answer: time to first token, tok/s, who served it, how it ended."""
    parts = []
    if stats.get("ttft_s") is not None:
        parts.append(f"{stats['ttft_s']:.2f} s to first token")
    if stats.get("tok_s") is not None:
        parts.append(f"{stats['tok_s']:.1f} tok/s")
    if stats.get("tokens") is not None:
        parts.append(f"{stats['tokens']} tokens")
    nodes = stats.get("nodes") or []
    if nodes:
        parts.append("served by " + " → ".join(names.get(n, n) for n in nodes))
    if stats.get("stopped"):
        parts.append("stopped")
    return " · ".join(parts)


def answer_problem(stats: dict[str, Any]) -> str:
    """What went wrong with an answer, in words ("" if nothing did)."""
    if stats.get("interrupted"):
        return f"Interrupted: {stats['interrupted']}."
    if stats.get("error"):
        return f"Error: {stats['error']}"
    return ""


def failed(stats: dict[str, Any]) -> bool:
    """Whether an answer broke off or ended in an error (and so may be asked again)."""
    return bool(stats.get("interrupted") or stats.get("error"))


def foot(stats: dict[str, Any], names: dict[str, str], note: str | None = None, retry: bool = False) -> str:
    """The small print under one answer; ``note`` for one still streaming, ``retry`` to offer
    asking again under a failed one."""
    line = html.escape(answer_stats(stats, names))
    if note:
        line = " · ".join(x for x in (line, f"<i>{html.escape(note)}</i>") if x)
    out = f'<p style="color:#6b7280"><small>{line}</small></p>' if line else ""
    problem = answer_problem(stats)
    if problem:
        link = ' &nbsp;<a href="retry:">Retry</a>' if retry else ""
        out = f'<p style="color:#b91c1c">⚠ {html.escape(problem)}{link}</p>' + out
    return out


def transcript_html(
    msgs: Sequence[Message], live: dict[str, Any] | None, names: dict[str, str], can_retry: bool
) -> tuple[str, list[str]]:
    """The conversation's HTML, and its code blocks (for their copy links). ``live`` is the
    answer being streamed (its text and figures stand in for the stored ones); ``can_retry``
    puts a Retry link under the last answer if it failed."""
    parts: list[str] = []
    blocks: list[str] = []
    for i, m in enumerate(msgs):
        streaming = live is not None and m.id == live["id"]
        text, stats = (live["text"], live["stats"]) if live is not None and streaming else (m.content, m.stats)
        if m.role == "user":
            parts.append(
                '<table width="100%" cellpadding="8" bgcolor="#e0f2fe"><tr><td>'
                f"<b>You</b><br>{html.escape(text).replace(chr(10), '<br>')}</td></tr></table>"
            )
            continue
        body, more = render(text or ("…" if streaming else "*(no text came back)*"), len(blocks))
        blocks += more
        if streaming:
            small = foot(stats, names, note=(live or {}).get("note"))
        else:
            small = foot(stats, names, retry=can_retry and i == len(msgs) - 1)
        parts.append(f"<div><b>Assistant</b>{body}{small}</div>")
    return "\n".join(parts), blocks
