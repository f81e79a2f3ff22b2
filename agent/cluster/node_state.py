"""What a node keeps across restarts: its id and its election term (platformdirs state folder).

Both files are written atomically (temp file, fsync, rename), and the term state is on disk
before the node acts on it: a restarted agent never votes twice in a term, never admits a
second coordinator in a term, and never goes back to an older term.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

from agent.cluster.election import TermState
from agent.common.paths import state_dir, write_json_atomic

log = logging.getLogger(__name__)


class StateError(RuntimeError):
    """The persisted state cannot be trusted; the agent must not start on it."""


def _read(path: Path) -> dict[str, Any] | None:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s is unreadable (%s)", path, e)
        return None
    return d if isinstance(d, dict) else None


def node_id(folder: Path | None = None) -> str:
    """This machine's node id: made once (12 hex digits), then read back."""
    p = (folder or state_dir()) / "node.json"
    d = _read(p)
    if d and isinstance(d.get("node_id"), str) and d["node_id"]:
        return str(d["node_id"])
    nid = uuid.uuid4().hex[:12]
    write_json_atomic(p, {"node_id": nid})
    log.info("new node id %s", nid)
    return nid


class TermStore:
    """The persisted :class:`TermState`. A corrupt file is a hard error: guessing could break fencing."""

    def __init__(self, folder: Path | None = None, *, persist: bool = True) -> None:
        self.path = (folder or state_dir()) / "term.json"
        self.persist = persist
        self.state = TermState()
        if not persist:
            return
        d = _read(self.path)
        if d is None and self.path.exists():
            raise StateError(f"{self.path} is corrupt; remove it only if this node is not coordinating")
        d = d or {}
        term, voted, leader = d.get("term", 0), d.get("voted_for"), d.get("leader")
        if not isinstance(term, int) or term < 0:
            raise StateError(f"{self.path} holds a bad term {term!r}")
        self.state = TermState(
            term, voted if isinstance(voted, str) else None, leader if isinstance(leader, str) else None
        )

    def save(self, ts: TermState) -> None:
        if ts == self.state:
            return
        if ts.term < self.state.term:
            raise ValueError(f"term may not go back from {self.state.term} to {ts.term}")
        if self.persist:
            write_json_atomic(self.path, {"term": ts.term, "voted_for": ts.voted_for, "leader": ts.leader})
        self.state = ts
