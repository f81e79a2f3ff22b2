"""Conversations, kept in SQLite in the platformdirs data folder (they survive restarts).

A conversation has a title, a system prompt, a model, its messages (each answer with its
figures: time to first token, tok/s, the nodes that served it and their names then, how it
ended) and the unsent draft. :meth:`Store.search` finds the conversations that say a word.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    model TEXT,
    draft TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content TEXT NOT NULL,
    stats TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation, id);
"""
NEW_TITLE = "New conversation"


@dataclass(frozen=True)
class Message:
    id: int
    role: str
    content: str
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    system_prompt: str
    model: str | None
    draft: str
    updated: float


def default_path() -> Path:
    import platformdirs

    h = os.environ.get("LAKESHARD_HOME")  # moves the tray's data along with the agent's
    d = Path(h).expanduser() / "data" if h else Path(platformdirs.user_data_dir("lakeshard"))
    d.mkdir(parents=True, exist_ok=True)
    return d / "conversations.sqlite3"


class Store:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path)
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.executescript(SCHEMA)
        self.db.commit()

    def close(self) -> None:
        self.db.close()

    # -- conversations --------------------------------------------------------------------------
    def conversations(self) -> list[Conversation]:
        rows = self.db.execute(
            "SELECT id, title, system_prompt, model, draft, updated FROM conversations ORDER BY updated DESC, id DESC"
        ).fetchall()
        return [Conversation(*r) for r in rows]

    def get(self, cid: int) -> Conversation | None:
        r = self.db.execute(
            "SELECT id, title, system_prompt, model, draft, updated FROM conversations WHERE id = ?", (cid,)
        ).fetchone()
        return Conversation(*r) if r else None

    def create(self, title: str = NEW_TITLE, system_prompt: str = "", model: str | None = None) -> int:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO conversations (title, system_prompt, model, created, updated) VALUES (?, ?, ?, ?, ?)",
            (title, system_prompt, model, now, now),
        )
        self.db.commit()
        assert cur.lastrowid is not None
        return cur.lastrowid

    def rename(self, cid: int, title: str) -> None:
        title = " ".join(title.split())[:200] or NEW_TITLE
        self.db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, cid))
        self.db.commit()

    def delete(self, cid: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id = ?", (cid,))
        self.db.commit()

    def set_system_prompt(self, cid: int, text: str) -> None:
        self.db.execute("UPDATE conversations SET system_prompt = ? WHERE id = ?", (text, cid))
        self.db.commit()

    def set_model(self, cid: int, model: str | None) -> None:
        self.db.execute("UPDATE conversations SET model = ? WHERE id = ?", (model, cid))
        self.db.commit()

    def set_draft(self, cid: int, text: str) -> None:
        self.db.execute("UPDATE conversations SET draft = ? WHERE id = ?", (text, cid))
        self.db.commit()

    # -- messages -------------------------------------------------------------------------------
    def messages(self, cid: int) -> list[Message]:
        rows = self.db.execute(
            "SELECT id, role, content, stats FROM messages WHERE conversation = ? ORDER BY id", (cid,)
        ).fetchall()
        return [Message(i, role, content, json.loads(stats or "{}")) for i, role, content, stats in rows]

    def add(self, cid: int, role: str, content: str, stats: dict[str, Any] | None = None) -> int:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO messages (conversation, role, content, stats, created) VALUES (?, ?, ?, ?, ?)",
            (cid, role, content, json.dumps(stats or {}), now),
        )
        self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, cid))
        if role == "user":  # a new conversation is named after its first question
            conv = self.get(cid)
            if conv is not None and conv.title == NEW_TITLE:
                self.rename(cid, content[:60])
        self.db.commit()
        assert cur.lastrowid is not None
        return cur.lastrowid

    def update(self, mid: int, content: str, stats: dict[str, Any] | None = None) -> None:
        self.db.execute(
            "UPDATE messages SET content = ?, stats = ? WHERE id = ?", (content, json.dumps(stats or {}), mid)
        )
        self.db.commit()

    def delete_message(self, mid: int) -> None:
        self.db.execute("DELETE FROM messages WHERE id = ?", (mid,))
        self.db.commit()

    def search(self, words: str, limit: int = 200) -> list[tuple[int, str]]:
        """The conversations whose title or messages contain ``words`` (case-insensitive for
        ASCII, as SQLite's LIKE), newest first, each with a snippet of its first match."""
        words = words.strip()
        if not words:
            return []
        like = "%" + words.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self.db.execute(
            "SELECT c.id, c.title, (SELECT m.content FROM messages m WHERE m.conversation = c.id"
            "   AND m.content LIKE ?1 ESCAPE '\\' ORDER BY m.id LIMIT 1) AS hit"
            " FROM conversations c WHERE c.title LIKE ?1 ESCAPE '\\' OR hit IS NOT NULL"
            " ORDER BY c.updated DESC, c.id DESC LIMIT ?2",
            (like, limit),
        ).fetchall()
        return [(cid, snippet(hit if hit is not None else title, words)) for cid, title, hit in rows]

    def history(self, cid: int) -> list[dict[str, str]]:
        """The conversation as OpenAI messages (system prompt first)."""
        conv = self.get(cid)
        out = []
        if conv is not None and conv.system_prompt.strip():
            out.append({"role": "system", "content": conv.system_prompt})
        out += [{"role": m.role, "content": m.content} for m in self.messages(cid) if m.content or m.role == "user"]
        return out


def snippet(text: str, words: str, width: int = 80) -> str:
    """The part of ``text`` around the first ``words`` (case-insensitive), on one line."""
    flat = " ".join(text.split())
    i = flat.lower().find(words.lower())
    if i < 0:
        return flat[:width]
    start = max(0, i - width // 3)
    out = flat[start : start + width]
    return ("…" if start else "") + out + ("…" if start + width < len(flat) else "")
