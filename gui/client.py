"""The tray's only way to the cluster: HTTP and websockets to the local agent and the coordinator.

By default both are the local agent (127.0.0.1), which forwards the chat API and the event
stream to the coordinator wherever it runs; a coordinator URL (and key) in the tray's
settings points the chat and the node map at another one instead. Everything here is
asyncio (it runs on the Qt loop through qasync) and never blocks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from agent.protocol.events import MAX_EVENT_BYTES, Event, parse_event

TIMEOUT = aiohttp.ClientTimeout(total=10, sock_connect=3)
# joining waits for the cluster member the token names (the agent gives it 10 s, TLS then plain)
JOIN_TIMEOUT = aiohttp.ClientTimeout(total=45, sock_connect=3)


class Unreachable(Exception):
    """Nobody answers (the agent is not running, or no coordinator is elected yet)."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class Chunk:
    """A piece of a streamed answer: text, or the end (with the finish reason and figures)."""

    text: str = ""
    finish: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


async def _raise_for(r: aiohttp.ClientResponse) -> None:
    if r.status < 400:
        return
    try:
        body = await r.json(content_type=None)
    except (ValueError, aiohttp.ClientError):
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message, code = str(err.get("message", "")), err.get("code")
    else:
        message, code = str(err or r.reason), None
    if r.status == 503 and code in ("no_coordinator", "not_serving"):
        raise Unreachable(message)
    raise ApiError(r.status, message, code)


class Client:
    def __init__(self, agent_url: str, coordinator_url: str | None = None, api_key: str | None = None) -> None:
        self.agent_url = agent_url.rstrip("/")
        self.coordinator_url = (coordinator_url or agent_url).rstrip("/")
        self.api_key = api_key
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _json(self, method: str, url: str, timeout: aiohttp.ClientTimeout = TIMEOUT, **kw: Any) -> Any:
        try:
            async with self.session.request(method, url, timeout=timeout, **kw) as r:
                await _raise_for(r)
                return await r.json(content_type=None)
        except (aiohttp.ClientConnectionError, TimeoutError) as e:
            raise Unreachable(f"nothing answers at {url} ({e})") from None

    # -- the local agent ---------------------------------------------------------------------
    async def node(self) -> dict[str, Any]:
        d: dict[str, Any] = await self._json("GET", f"{self.agent_url}/v1/node")
        return d

    async def cluster(self) -> dict[str, Any]:
        d: dict[str, Any] = await self._json("GET", f"{self.agent_url}/v1/cluster")
        return d

    async def set_state(self, state: str, for_s: float | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"state": state}
        if for_s is not None:
            body["for_s"] = for_s
        d: dict[str, Any] = await self._json("POST", f"{self.agent_url}/v1/node/state", json=body)
        return d

    async def settings(self) -> dict[str, Any]:
        d: dict[str, Any] = await self._json("GET", f"{self.agent_url}/v1/settings")
        return d

    async def put_settings(self, settings: dict[str, Any] | None = None, text: str | None = None) -> dict[str, Any]:
        body = {"settings": settings} if text is None else {"text": text}
        d: dict[str, Any] = await self._json("PUT", f"{self.agent_url}/v1/settings", json=body)
        return d

    # -- cluster identity, through the local agent (agent/cluster_api.py) ---------------------
    async def cluster_identity(self) -> dict[str, Any]:
        d: dict[str, Any] = await self._json("GET", f"{self.agent_url}/v1/cluster/identity")
        return d

    async def cluster_init(self) -> dict[str, Any]:
        d: dict[str, Any] = await self._json("POST", f"{self.agent_url}/v1/cluster/init", json={})
        return d

    async def cluster_join(self, token: str) -> dict[str, Any]:
        url = f"{self.agent_url}/v1/cluster/join"
        d: dict[str, Any] = await self._json("POST", url, json={"token": token}, timeout=JOIN_TIMEOUT)
        return d

    async def cluster_invite(self, expires: str = "24h", uses: int = 1, address: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"expires": expires, "uses": uses}
        if address:
            body["address"] = address
        d: dict[str, Any] = await self._json("POST", f"{self.agent_url}/v1/cluster/invite", json=body)
        return d

    async def cluster_revoke(self, node: str) -> dict[str, Any]:
        d: dict[str, Any] = await self._json("POST", f"{self.agent_url}/v1/cluster/revoke", json={"node": node})
        return d

    # -- the model the cluster serves, through the local agent (agent/cluster_model_api.py) -----
    async def cluster_model(self) -> dict[str, Any]:
        d: dict[str, Any] = await self._json("GET", f"{self.agent_url}/v1/cluster/model")
        return d

    async def set_cluster_model(self, model: str, weights: str | None, draft: str | None) -> dict[str, Any]:
        body = {"model": model, "weights": weights, "draft": draft}
        d: dict[str, Any] = await self._json("PUT", f"{self.agent_url}/v1/cluster/model", json=body)
        return d

    # -- the coordinator ---------------------------------------------------------------------
    async def models(self) -> list[str]:
        d = await self._json("GET", f"{self.coordinator_url}/v1/models", headers=self._headers())
        return [str(m["id"]) for m in d.get("data", []) if isinstance(m, dict) and "id" in m]

    async def chat(
        self, messages: list[dict[str, str]], model: str | None = None, max_tokens: int = 1024, **extra: Any
    ) -> AsyncIterator[Chunk]:
        """Stream one answer. Closing the generator (Stop) closes the request, which cancels the
        generation on the cluster."""
        body: dict[str, Any] = {"messages": messages, "stream": True, "max_tokens": max_tokens, **extra}
        if model:
            body["model"] = model
        url = f"{self.coordinator_url}/v1/chat/completions"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=3, sock_read=600)
        try:
            async with self.session.post(url, json=body, headers=self._headers(), timeout=timeout) as r:
                await _raise_for(r)
                async for raw in r.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    msg = json.loads(data)
                    if "error" in msg:
                        err = msg["error"]
                        raise ApiError(503, str(err.get("message", err)), err.get("code"))
                    for ch in msg.get("choices", []):
                        text = (ch.get("delta") or {}).get("content") or ""
                        fin = ch.get("finish_reason")
                        if text or fin:
                            yield Chunk(text, fin, msg.get("lakeshard") or {})
        except (aiohttp.ClientConnectionError, TimeoutError) as e:
            raise Unreachable(f"the coordinator did not answer ({e})") from None

    async def events(self) -> AsyncIterator[Event]:
        """The cluster event stream, from its snapshot on, until the connection ends."""
        url = f"{self.coordinator_url}/v1/cluster/events"
        try:
            async with self.session.ws_connect(
                url, headers=self._headers(), heartbeat=10.0, max_msg_size=MAX_EVENT_BYTES
            ) as ws:
                async for m in ws:
                    if m.type != aiohttp.WSMsgType.TEXT:
                        break
                    yield parse_event(m.data)
        except (aiohttp.ClientConnectionError, aiohttp.WSServerHandshakeError, TimeoutError) as e:
            raise Unreachable(f"no event stream at {url} ({e})") from None
