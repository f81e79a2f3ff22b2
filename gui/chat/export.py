"""A conversation as a Markdown file (pure but for the file it writes): its title, model and
system prompt, then each question and answer as they were (answers are Markdown already, their
code blocks kept as written), each answer with its figures and who served it."""

from __future__ import annotations

import re
import time
from pathlib import Path

from gui.chat.store import Store
from gui.chat.transcript import answer_problem, answer_stats


def conversation_markdown(store: Store, cid: int, names: dict[str, str] | None = None) -> str:
    """Conversation ``cid`` as Markdown (``names``: the cluster's node names, for answers that
    recorded none of their own)."""
    conv = store.get(cid)
    if conv is None:
        raise KeyError(f"no conversation {cid}")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv.updated))
    head = [f"# {conv.title}", "", f"*lakeshard chat · {conv.model or 'the served model'} · {when}*", ""]
    if conv.system_prompt.strip():
        head += ["**System prompt**", "", *(f"> {line}" for line in conv.system_prompt.splitlines()), ""]
    out = head
    for m in store.messages(cid):
        if m.role == "user":
            out += ["## You", "", m.content.rstrip(), ""]
            continue
        out += ["## Assistant", "", m.content.rstrip() or "*(no text came back)*", ""]
        small = " · ".join(x for x in (answer_problem(m.stats), answer_stats(m.stats, names or {})) if x)
        if small:
            out += [f"*{small}*", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def file_name(title: str) -> str:
    """A file name for a conversation called ``title`` (letters, digits, dashes; ``.md``)."""
    stem = re.sub(r"[^\w]+", "-", title, flags=re.UNICODE).strip("-_")[:60] or "conversation"
    return f"{stem}.md"


def export(store: Store, cid: int, path: Path, names: dict[str, str] | None = None) -> Path:
    """Write conversation ``cid`` to ``path`` as Markdown (UTF-8); the path written."""
    path.write_text(conversation_markdown(store, cid, names), encoding="utf-8")
    return path
