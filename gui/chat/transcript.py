"""A conversation as the chat window shows it (pure): the questions, the answers rendered
from Markdown, and the small print under each answer (its figures and who served it, a note
from the cluster while it waits, how it ended, and, under the last one, what can be done with
it: Retry, Continue, Regenerate, Edit), in the colours of a :class:`~gui.chat.theme.Theme`."""

from __future__ import annotations

import html
from collections.abc import Collection, Sequence
from typing import Any

from gui.chat.markdown import render
from gui.chat.store import Message
from gui.chat.theme import Theme

# the links under the last answer, in the order they are shown: (href, words)
ACTIONS = (("retry", "Retry"), ("continue", "Continue"), ("regenerate", "Regenerate"), ("edit", "Edit"))


def served_by(stats: dict[str, Any], names: dict[str, str]) -> str:
    """Who computed an answer, by name: each plan it ran on in stage order ("ann → bob"), and
    after a failover the next ("ann → bob, then carol"). The names recorded with the answer
    come first; ``names`` (the cluster as known now) only for an answer that recorded none."""
    nodes = stats.get("nodes") or []
    plans = stats.get("plans") or ([nodes] if nodes else [])
    known = {**names, **(stats.get("names") or {})}
    return ", then ".join(" → ".join(known.get(n, n) for n in plan) for plan in plans)


def answer_stats(stats: dict[str, Any], names: dict[str, str]) -> str:
    """The line under an answer: time to first token, tok/s, who served it, how it ended."""
    parts = []
    if stats.get("ttft_s") is not None:
        parts.append(f"{stats['ttft_s']:.2f} s to first token")
    if stats.get("tok_s") is not None:
        parts.append(f"{stats['tok_s']:.1f} tok/s")
    if stats.get("tokens") is not None:
        parts.append(f"{stats['tokens']} tokens")
    who = served_by(stats, names)
    if who:
        parts.append("served by " + who)
    if stats.get("stopped"):
        parts.append("stopped")
    elif stats.get("finish") == "length":
        parts.append("stopped: length")
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


def cut_short(stats: dict[str, Any]) -> bool:
    """Whether an answer ended at the token limit (finish reason ``length``): Continue goes on."""
    return stats.get("finish") == "length" and not failed(stats) and not stats.get("stopped")


def foot(
    stats: dict[str, Any], names: dict[str, str], theme: Theme, note: str | None = None, offer: Collection[str] = ()
) -> str:
    """The small print under one answer; ``note`` for one still streaming; ``offer``: the
    actions linked under it (of :data:`ACTIONS`; Retry shows with the problem it would fix)."""
    line = html.escape(answer_stats(stats, names))
    if note:
        line = " · ".join(x for x in (line, f"<i>{html.escape(note)}</i>") if x)
    links = " &nbsp; ".join(
        f'<a href="{a}:" style="color:{theme.link}">{words}</a>' for a, words in ACTIONS if a in offer and a != "retry"
    )
    line = " &nbsp; ".join(x for x in (line, links) if x)
    out = f'<p style="color:{theme.muted}"><small>{line}</small></p>' if line else ""
    problem = answer_problem(stats)
    if problem:
        link = f' &nbsp;<a href="retry:" style="color:{theme.link}">Retry</a>' if "retry" in offer else ""
        out = f'<p style="color:{theme.error}">⚠ {html.escape(problem)}{link}</p>' + out
    return out


def transcript_html(
    msgs: Sequence[Message],
    live: dict[str, Any] | None,
    names: dict[str, str],
    theme: Theme,
    offer: Collection[str] = (),
) -> tuple[str, list[str]]:
    """The conversation's HTML, and its code blocks (for their copy links). ``live`` is the
    answer being streamed (its text and figures stand in for the stored ones); ``offer`` the
    actions linked under the last answer (see :func:`foot`)."""
    parts: list[str] = []
    blocks: list[str] = []
    for i, m in enumerate(msgs):
        streaming = live is not None and m.id == live["id"]
        text, stats = (live["text"], live["stats"]) if live is not None and streaming else (m.content, m.stats)
        if m.role == "user":
            parts.append(
                f'<table width="100%" cellpadding="8" bgcolor="{theme.user_bg}"><tr><td style="color:{theme.text}">'
                f"<b>You</b><br>{html.escape(text).replace(chr(10), '<br>')}</td></tr></table>"
            )
            continue
        body, more = render(text or ("…" if streaming else "*(no text came back)*"), theme, len(blocks))
        blocks += more
        if streaming:
            small = foot(stats, names, theme, note=(live or {}).get("note"))
        else:
            small = foot(stats, names, theme, offer=offer if i == len(msgs) - 1 else ())
        parts.append(f'<div style="color:{theme.text}"><b>Assistant</b>{body}{small}</div>')
    return "\n".join(parts), blocks
