"""A fake of the local agent as the tray's windows see it through :class:`gui.client.Client`, in
process (no sockets): ``/v1/node`` and the pause switch, the settings (the file, and what the
agent runs with), the cluster's model, and an event stream the test feeds. For offscreen GUI
unit tests; the agent's own behaviour (the switch, a setting that applies at once, a create or a
join) is played by the callbacks a test gives."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Callable
from typing import Any

import yaml

from agent.common.config import parse, to_mapping
from agent.protocol.events import Event

NODE: dict[str, Any] = {
    "node": "me",
    "name": "alice-laptop",
    "state": "available",
    "role": "follower",
    "coordinator": "carol",
    "peers": 2,
    "stage": {"assigned": False},
    "throttle_policy": {"idle_minutes": 2.0, "while_in_use": "pause"},
}


class FakeBackend:
    """``node``: the agent's ``/v1/node`` now. A read of it answers what it was when the read
    began; ``hold``, when set, keeps reads waiting (a poll in flight). ``switch(state, for_s)``
    plays the agent's answer to the pause switch (default: the state, with the switch's reason);
    ``on_settings(file)`` plays a saved settings file (default: nothing changes); ``join(token)``
    and ``init()`` play the agent's answer to a join and a create (default: it is then in cluster
    ``office-3f``; a test's may raise :class:`gui.client.ApiError`, the agent's refusal). Each
    token asked to join is kept in ``joins``, each create counted in ``inits``."""

    def __init__(self, node: dict[str, Any] | None = None) -> None:
        self.node_json: dict[str, Any] = copy.deepcopy(node or NODE)
        self.hold: asyncio.Event | None = None
        self.reads = 0
        self.switched: list[tuple[str, float | None]] = []
        self.switch: Callable[[str, float | None], dict[str, Any]] = self._switch
        self.file: dict[str, Any] = {}  # config.yaml
        self.effective: dict[str, Any] | None = None  # what the agent runs with (None: as the file says)
        self.restart: list[str] = []  # what a save answers as applying after a restart
        self.put: list[dict[str, Any]] = []
        self.on_settings: Callable[[dict[str, Any]], None] = lambda _file: None
        self.models: list[dict[str, Any]] = [
            {"name": "smollm2-135m", "pulled": True, "source": "registry"},
            {"name": "qwen2.5-coder-1.5b", "pulled": False, "source": "registry"},
        ]
        self.joins: list[str] = []
        self.inits = 0
        self.join: Callable[[str], dict[str, Any]] = lambda _token: self._member("joined cluster office-3f as node me")
        self.init: Callable[[], dict[str, Any]] = lambda: self._member("cluster office-3f: made", holds_ca=True)
        self.events_q: asyncio.Queue[Event] = asyncio.Queue()
        self.closed = False
        self.agent_url = "http://127.0.0.1:7701"
        self.coordinator_url = self.agent_url
        self.api_key: str | None = None

    # -- the local agent ---------------------------------------------------------------------
    async def node(self) -> dict[str, Any]:
        answer = copy.deepcopy(self.node_json)  # as of the request
        self.reads += 1
        if self.hold is not None:
            await self.hold.wait()
        return answer

    def _switch(self, state: str, for_s: float | None) -> dict[str, Any]:
        d = copy.deepcopy(self.node_json)
        if state == "available":
            d.update(state="available", reason=None, reason_kind=None, paused_until=None)
        else:
            d.update(state=state, reason="user", reason_kind="switch")
        return d

    async def set_state(self, state: str, for_s: float | None = None) -> dict[str, Any]:
        self.switched.append((state, for_s))
        self.node_json = self.switch(state, for_s)
        return copy.deepcopy(self.node_json)

    async def settings(self) -> dict[str, Any]:
        from_file = to_mapping(parse(self.file or None))
        return {
            "file": "/home/alice/.config/lakeshard/config.yaml",
            "exists": bool(self.file),
            "text": yaml.safe_dump(self.file, sort_keys=False) if self.file else "",
            "settings": copy.deepcopy(self.file),
            "effective": copy.deepcopy(self.effective) if self.effective is not None else from_file,
            "from_file": from_file,
        }

    async def put_settings(self, settings: dict[str, Any] | None = None, text: str | None = None) -> dict[str, Any]:
        new = settings if text is None else (yaml.safe_load(text) or {})
        assert isinstance(new, dict)
        parse(new)  # the agent's own check
        self.put.append(copy.deepcopy(new))
        self.file = copy.deepcopy(new)
        self.on_settings(self.file)
        return {"ok": True, "file": "/home/alice/.config/lakeshard/config.yaml", "restart": list(self.restart)}

    def _member(self, message: str, holds_ca: bool = False) -> dict[str, Any]:
        """The agent, now a member of cluster office-3f: its answer to a create or a join."""
        self.node_json.update(state="available", role="follower", cluster="office-3f", holds_ca=holds_ca)
        self.node_json.pop("hint", None)
        return {"cluster_id": "office-3f", "node_id": "me", "message": message, "agent_error": None}

    async def cluster_init(self) -> dict[str, Any]:
        self.inits += 1
        return self.init()

    async def cluster_join(self, token: str) -> dict[str, Any]:
        self.joins.append(token)
        return self.join(token)

    async def cluster_model(self) -> dict[str, Any]:
        return {
            "cluster": {"model": "smollm2-135m", "weights": None, "draft": None, "label": "set by alice-laptop"},
            "override": None,
            "models": copy.deepcopy(self.models),
            "weights": ["fp16", "int8", "int4"],
        }

    async def pulls(self) -> list[dict[str, Any]]:
        return []

    async def events(self) -> AsyncIterator[Event]:
        while True:
            yield await self.events_q.get()

    def point_at(self, coordinator_url: str | None, api_key: str | None = None) -> None:
        self.coordinator_url = coordinator_url or self.agent_url
        self.api_key = api_key

    async def close(self) -> None:
        self.closed = True
