"""The tray's only way to the cluster: HTTP and websockets to the local agent and the coordinator.

By default both are the local agent (127.0.0.1), which forwards the chat API and the event
stream to the coordinator wherever it runs; a coordinator URL (and key) in the tray's
settings points the chat and the node map at another one instead. Everything here is
asyncio (it runs on the Qt loop through qasync) and never blocks.

Every failure of the network reaches callers as one of this module's exceptions, never as
aiohttp's own: :class:`Unreachable` (nothing answered; :class:`BadAddress` when the URL
itself is wrong), :class:`ApiError` (the server answered with an error) and, for a streamed
answer that had begun, :class:`Interrupted`. The windows handle those three and stay usable.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from agent.protocol.cluster_view import MAX_EVENT_BYTES
from agent.protocol.codec import ProtocolError
from agent.protocol.events import Event, parse_event

TIMEOUT = aiohttp.ClientTimeout(total=10, sock_connect=3)
# joining waits for the cluster member the token names (the agent gives it 10 s, TLS then plain)
JOIN_TIMEOUT = aiohttp.ClientTimeout(total=45, sock_connect=3)
# a streamed answer may pause (a long prompt's prefill, or the gateway finding a new
# coordinator and splicing the rest in): only this long a silence ends it
STREAM_READ_S = 600.0
# what breaks a request: refused, reset, cut mid-body, timed out, an unusable URL or a garbled reply
TRANSPORT_ERRORS = (aiohttp.ClientError, OSError, TimeoutError, ValueError, HttpProcessingError)


class Unreachable(Exception):
    """Nobody answers (the agent is not running, or no coordinator is elected yet)."""


class BadAddress(Unreachable):
    """The coordinator URL in the settings is not one that can be asked at all."""


class NotServing(Unreachable):
    """A coordinator answers, but its API cannot yet (it prepares the model, or has none);
    the message says why, with the step it is at."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class Interrupted(Exception):
    """A streamed answer broke off after it had begun (the connection was cut, the stream
    ended before its end, or it carried something unreadable); what came so far is kept.
    The message is for the user; ``detail`` is the technical cause, for the log."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a coordinator's address (None: it can; empty means "through the
    local agent"). Pure, for the settings form and for a URL already stored."""
    url = url.strip()
    if not url:
        return None
    if any(c.isspace() for c in url):
        return "it must not contain spaces"
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as e:  # "Port out of range 0-65535", "Invalid IPv6 URL", ...
        return f"it is not a valid URL ({e})"
    if u.scheme not in ("http", "https"):
        return "it must start with http:// or https:// (e.g. http://10.0.0.5:8000)"
    if not u.hostname:
        return "it names no host (e.g. http://10.0.0.5:8000)"
    if port == 0:
        return "port 0 is not a port (use 1-65535)"
    if u.query or u.fragment or url.endswith(("?", "#")):
        return "it must not have a ?query or #fragment"
    return None


def base_url(url: str) -> str:
    """The URL the API paths go under: without a trailing slash, and without the OpenAI
    convention's ``/v1`` (``http://host:8000/v1`` is taken to mean ``http://host:8000``)."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass(frozen=True)
class Chunk:
    """A piece of a streamed answer: text, a status note, or the end (with the finish reason and figures)."""

    text: str = ""
    finish: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    note: str | None = None  # a word from the cluster while the answer waits (e.g. "interrupted: retrying…")


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
    if r.status == 503 and code == "not_serving":
        raise NotServing(message)
    if r.status == 503 and code == "no_coordinator":
        raise Unreachable(message)
    raise ApiError(r.status, message, code)


class Client:
    def __init__(self, agent_url: str, coordinator_url: str | None = None, api_key: str | None = None) -> None:
        self.agent_url = agent_url.rstrip("/")
        self.coordinator_url = self.agent_url
        self.api_key: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self.point_at(coordinator_url, api_key)

    def point_at(self, coordinator_url: str | None, api_key: str | None = None) -> None:
        """Ask this coordinator from now on (None or empty: the local agent). A bad URL is
        kept as given: each request to it then fails with :class:`BadAddress`."""
        url = str(coordinator_url or "").strip()
        self.coordinator_url = base_url(url) if url and not url_problem(url) else (url or self.agent_url)
        self.api_key = api_key or None

    def _coordinator(self, path: str) -> str:
        """The coordinator's URL for ``path``, or :class:`BadAddress` when the settings' URL is wrong."""
        why = url_problem(self.coordinator_url)
        if why:
            raise BadAddress(f"the coordinator URL {self.coordinator_url!r} in Settings is not valid: {why}")
        return f"{base_url(self.coordinator_url)}{path}"

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
                try:
                    return await r.json(content_type=None)
                except ValueError:
                    raise ApiError(r.status, f"{url} answered something that is not JSON") from None
        except aiohttp.InvalidURL as e:
            raise BadAddress(f"{url} is not a valid URL ({e})") from None
        except TRANSPORT_ERRORS as e:
            raise Unreachable(f"nothing answers at {url} ({_say(e)})") from None

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

    # -- cluster identity, through the local agent (agent/security/local_routes.py) ---------------------
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

    # -- the model the cluster serves, through the local agent (agent/api/cluster_model.py) -----
    async def cluster_model(self) -> dict[str, Any]:
        d: dict[str, Any] = await self._json("GET", f"{self.agent_url}/v1/cluster/model")
        return d

    async def set_cluster_model(self, model: str, weights: str | None, draft: str | None) -> dict[str, Any]:
        body = {"model": model, "weights": weights, "draft": draft}
        d: dict[str, Any] = await self._json("PUT", f"{self.agent_url}/v1/cluster/model", json=body)
        return d

    # -- model pulls into this laptop's store, through the local agent (agent/models/pulls.py) --
    async def pull_model(self, model: str) -> dict[str, Any]:
        d: dict[str, Any] = await self._json("POST", f"{self.agent_url}/v1/models/pull", json={"model": model})
        return d

    async def pulls(self) -> list[dict[str, Any]]:
        d = await self._json("GET", f"{self.agent_url}/v1/models/pulls")
        got = d.get("pulls") if isinstance(d, dict) else None
        return [p for p in got or [] if isinstance(p, dict) and "model" in p]

    # -- the coordinator ---------------------------------------------------------------------
    async def models(self) -> list[str]:
        d = await self._json("GET", self._coordinator("/v1/models"), headers=self._headers())
        if not isinstance(d, dict):
            raise ApiError(502, f"the coordinator URL answered something that is not a model list: {str(d)[:80]}")
        return [str(m["id"]) for m in d.get("data") or [] if isinstance(m, dict) and "id" in m]

    async def chat(
        self, messages: list[dict[str, str]], model: str | None = None, max_tokens: int = 1024, **extra: Any
    ) -> AsyncIterator[Chunk]:
        """Stream one answer. Closing the generator (Stop) closes the request, which cancels the
        generation on the cluster.

        Raises :class:`Unreachable` when no answer began (refused, a bad URL, no coordinator),
        :class:`ApiError` for an error the server reports, and :class:`Interrupted` when a
        begun answer breaks off: cut, silent for ``STREAM_READ_S``, ended before its end
        (``[DONE]`` or a finish reason), or garbled. Comment lines (``: ...``, keep-alives
        while the cluster finds a new coordinator) are skipped; a data event with
        ``{"lakeshard": {"status": "..."}}`` becomes a :attr:`Chunk.note`."""
        url = self._coordinator("/v1/chat/completions")
        body: dict[str, Any] = {"messages": messages, "stream": True, "max_tokens": max_tokens, **extra}
        if model:
            body["model"] = model
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=3, sock_read=STREAM_READ_S)
        async with contextlib.AsyncExitStack() as stack:
            try:
                r = await stack.enter_async_context(
                    self.session.post(url, json=body, headers=self._headers(), timeout=timeout)
                )
            except aiohttp.InvalidURL as e:
                raise BadAddress(f"{url} is not a valid URL ({e})") from None
            except TRANSPORT_ERRORS as e:
                raise Unreachable(f"the coordinator did not answer ({_say(e)})") from None
            try:
                await _raise_for(r)
            except TRANSPORT_ERRORS as e:
                raise Unreachable(f"the coordinator did not answer ({_say(e)})") from None
            kind = r.headers.get("Content-Type", "text/event-stream").split(";")[0].strip().lower()
            if kind != "text/event-stream":
                raise ApiError(r.status, f"{url} answered with {kind}, not a stream of events: is it the chat API?")
            finished = False
            async for event in _sse_events(r):
                if event.strip() == "[DONE]":
                    return
                chunk = _chunk(event)
                if chunk is None:
                    continue
                finished = finished or chunk.finish is not None
                yield chunk
            if not finished:
                raise Interrupted("the stream ended before the answer was complete", "no [DONE], no finish reason")

    async def events(self) -> AsyncIterator[Event]:
        """The cluster event stream, from its snapshot on, until the connection ends. Events of
        a type this version does not know (a newer coordinator's) are skipped."""
        url = self._coordinator("/v1/cluster/events")
        try:
            async with self.session.ws_connect(
                url, headers=self._headers(), heartbeat=10.0, max_msg_size=MAX_EVENT_BYTES
            ) as ws:
                async for m in ws:
                    if m.type != aiohttp.WSMsgType.TEXT:
                        break
                    try:
                        ev = parse_event(m.data)
                    except ProtocolError as e:
                        if e.code == "unknown_type":
                            continue
                        raise
                    yield ev
        except aiohttp.InvalidURL as e:
            raise BadAddress(f"{url} is not a valid URL ({e})") from None
        except TRANSPORT_ERRORS as e:
            raise Unreachable(f"no event stream at {url} ({_say(e)})") from None


def _say(e: BaseException) -> str:
    """An exception in words (some of aiohttp's have none of their own)."""
    text = str(e).strip()
    return text or type(e).__name__


async def _sse_events(r: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The data of each server-sent event of ``r`` (data lines joined; comments and other
    fields skipped). A broken or silent stream is :class:`Interrupted`."""
    data: list[str] = []
    try:
        async for raw in r.content:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not line:
                if data:
                    yield "\n".join(data)
                    data = []
                continue
            if line.startswith(":"):
                continue  # a comment: a keep-alive during a pause
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
    except TRANSPORT_ERRORS as e:
        if isinstance(e, TimeoutError):
            raise Interrupted(f"the coordinator sent nothing for {STREAM_READ_S:.0f} s", _say(e)) from None
        raise Interrupted("the connection to the coordinator broke off", _say(e)) from None
    if data:  # the last event, without its blank line
        yield "\n".join(data)


def _chunk(event: str) -> Chunk | None:
    """One data event of a chat stream as a chunk (None: nothing for the reader in it).
    Unknown fields are ignored; an error event is :class:`ApiError`; unreadable JSON is
    :class:`Interrupted`."""
    try:
        msg = json.loads(event)
    except ValueError:
        raise Interrupted("the stream carried something unreadable", event[:200]) from None
    if not isinstance(msg, dict):
        raise Interrupted("the stream carried something unreadable", event[:200])
    if "error" in msg:
        err = msg["error"]
        if isinstance(err, dict):
            raise ApiError(503, str(err.get("message") or err), err.get("code"))
        raise ApiError(503, str(err))
    extra = msg.get("lakeshard")
    extra = extra if isinstance(extra, dict) else {}
    note = extra.get("status")
    text, finish = "", None
    for ch in msg.get("choices") or []:
        if not isinstance(ch, dict):
            continue
        delta = ch.get("delta")
        piece = delta.get("content") if isinstance(delta, dict) else None
        text += piece if isinstance(piece, str) else ""
        finish = finish or (str(ch["finish_reason"]) if ch.get("finish_reason") else None)
    if not (text or finish or isinstance(note, str)):
        return None
    stats = {k: v for k, v in extra.items() if k != "status"}
    return Chunk(text, finish, stats, note if isinstance(note, str) else None)
