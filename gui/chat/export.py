"""Export a conversation as a Markdown file: its title, model and system prompt, then each question
and answer as they were (answers are Markdown already, their code blocks kept as written), each
answer with its figures and who served it. The Markdown is made without Qt
(:func:`conversation_markdown`); the chat window's Export asks where to save it
(:func:`save_dialog`)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from PySide6.QtCore import QStandardPaths
from PySide6.QtWidgets import QFileDialog, QMessageBox, QWidget

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


def save_dialog(parent: QWidget, store: Store, cid: int, names: dict[str, str] | None = None) -> Path | None:
    """Export: ask where to save conversation ``cid`` (in the documents folder by default, named
    after its title) and save it there; the path written (None: cancelled, or it could not be
    written, which a message box has said)."""
    conv = store.get(cid)
    where = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation) or str(Path.home())
    name = file_name(conv.title if conv else "conversation")
    path, _ = QFileDialog.getSaveFileName(
        parent, "Export conversation", str(Path(where) / name), "Markdown (*.md);;All files (*)"
    )
    if not path:
        return None
    try:
        return export(store, cid, Path(path), names)
    except OSError as e:
        QMessageBox.warning(parent, "Export conversation", f"Could not write {path}: {e.strerror or e}")
        return None
