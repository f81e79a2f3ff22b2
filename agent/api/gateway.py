"""Every laptop's door to its coordinator: the chat API and the cluster event stream, forwarded.

The coordinator's OpenAI-compatible API listens on 127.0.0.1 of whichever laptop won the
election, and the event stream is published there. A tray on any laptop talks only to its
own agent (127.0.0.1); the agent forwards to the coordinator:

* on the coordinator itself: straight to its services (the API on 127.0.0.1, the hub in
  process);
* elsewhere: to the coordinator agent's public port, which serves the same routes to the
  cluster's members only (loopback and live peers' addresses) and forwards them locally.

A client that goes away mid-answer closes the forwarded request too, so the coordinator
cancels the generation on every stage. Each hop names the address it received the request
from in ``X-Forwarded-For``, which the coordinator trusts from loopback only: its request
limits then count a member laptop (everyone on it together) as one client, and the
coordinator laptop's own users as 127.0.0.1. When no coordinator is reachable the answer is an
OpenAI-style JSON error (503, ``no_coordinator``), and the event relay says
``coordinator_lost`` and follows the next coordinator when one is elected.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from agent.api.events import HEARTBEAT_S, EventHub, HubClosed, async_serve_events
from agent.api.resume import RESUME_HEADER, async_stream_with_resume, async_whole_with_retry
from agent.common.http import api_error
from agent.protocol.cluster_view import MAX_EVENT_BYTES
from agent.protocol.events import CoordinatorLost
from agent.security.errors import SecurityError
from agent.security.transport import Transport

log = logging.getLogger(__name__)
RECHECK_S = 0.25  # how often a relay looks for a (new) coordinator
FORWARD_HEADERS = ("Content-Type", "Authorization", "Accept", RESUME_HEADER)


@dataclass(frozen=True)
class Target:
    """Where the coordinator's services are, as seen from this agent."""

    node: str
    api: str | None = None  # this node coordinates: its API's base URL (None: no API yet)
    hub: EventHub | None = None  # and its event hub
    peer: str | None = None  # another node coordinates: host:port of its agent
    not_ready: str | None = None  # why its API cannot answer yet


class Door(Protocol):
    """What the gateway needs of the daemon."""

    @property
    def session(self) -> aiohttp.ClientSession | None: ...

    @property
    def transport(self) -> Transport | None: ...  # how node links travel (None: not a member yet)

    def coordinator_target(self) -> Target | None: ...

    def is_member_address(self, ip: str) -> bool: ...

    @property
    def stopping(self) -> bool: ...


DOOR: web.AppKey[Door] = web.AppKey("door")


def _no_coordinator() -> web.Response:
    return api_error(
        503, "no coordinator is reachable right now (an election may be under way); retry", "no_coordinator"
    )


async def async_forward(request: web.Request, url: str, session: aiohttp.ClientSession) -> web.StreamResponse:
    """Forward ``request`` to ``url`` and stream the answer back as it comes."""
    body = await request.read()
    headers = {k: request.headers[k] for k in FORWARD_HEADERS if k in request.headers}
    # who asked, for the coordinator's per-client limits: the address this request came from
    # (a client's own X-Forwarded-For is not passed on: only the hop that saw it may say)
    if request.remote:
        headers["X-Forwarded-For"] = request.remote
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=None)
    try:
        async with session.request(request.method, url, data=body, headers=headers, timeout=timeout) as up:
            out = web.StreamResponse(status=up.status, reason=up.reason)
            for k in ("Content-Type", "Cache-Control", "Retry-After"):
                if k in up.headers:
                    out.headers[k] = up.headers[k]
            await out.prepare(request)
            try:
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except (ConnectionError, RuntimeError):
                # our client left: leaving this block closes the upstream connection, and the
                # coordinator cancels the generation
                log.info("client of %s went away; forwarded request closed", request.path)
                up.close()
            return out
    except (aiohttp.ClientConnectionError, TimeoutError, OSError) as e:
        return api_error(503, f"the coordinator did not answer: {e}", "no_coordinator")


async def _not_node(tr: Transport, address: str, node: str) -> str | None:
    """Why the node serving ``address`` is not ``node`` by its certificate (None: it is, or the
    links are plaintext and there is nothing to check)."""
    try:
        seen = await tr.node_at(address)
    except SecurityError as e:
        return f"the coordinator at {address} is refused: {e}"
    if seen is not None and seen != node:
        return f"the coordinator is node {node}, but the certificate at {address} names node {seen}"
    return None


async def _where(door: Door, path: str, *, from_peer: bool) -> str | web.Response:
    """The URL of ``path`` at the coordinator, or why the request cannot go there now."""
    t = door.coordinator_target()
    if t is None or door.session is None:
        return _no_coordinator()
    if t.peer is not None:
        tr = door.transport
        # a member asked us, but we no longer coordinate: it will find the new one (no transport:
        # this agent is no member yet, and hears no coordinator anyway)
        if from_peer or tr is None:
            return _no_coordinator()
        wrong = await _not_node(tr, t.peer, t.node)
        if wrong is not None:
            log.warning("refused to forward %s: %s", path, wrong)
            return api_error(502, wrong, "wrong_coordinator")
        return tr.url(t.peer, path)
    if t.api is None:
        return api_error(503, t.not_ready or "the coordinator has no model to serve", "not_serving")
    return f"{t.api}{path}"


async def _to_coordinator(request: web.Request, *, from_peer: bool) -> web.StreamResponse:
    door = request.app[DOOR]
    url = await _where(door, str(request.rel_url), from_peer=from_peer)
    if isinstance(url, web.Response):
        return url
    assert door.session is not None
    return await async_forward(request, url, door.session)


async def async_local_api(request: web.Request) -> web.StreamResponse:
    """The coordinator's API routes on the local status API. A chat answer outlives its
    coordinator: it goes on with the next one (:mod:`agent.api.resume`); the others (models, a
    legacy text completion) are forwarded as they are."""
    if request.method != "POST" or request.path != "/v1/chat/completions":
        return await _to_coordinator(request, from_peer=False)
    door = request.app[DOOR]
    raw = await request.read()
    headers = {k: request.headers[k] for k in FORWARD_HEADERS if k in request.headers}
    if request.remote:
        headers["X-Forwarded-For"] = request.remote
    path = str(request.rel_url)

    async def upstream(body: bytes, hdrs: dict[str, str]) -> aiohttp.ClientResponse | web.Response:
        url = await _where(door, path, from_peer=False)
        if isinstance(url, web.Response):
            return url
        assert door.session is not None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=None)
        return await door.session.post(url, data=body, headers=hdrs, timeout=timeout)

    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("stream") is True:
        return await async_stream_with_resume(request, body, headers, upstream, lambda: door.stopping)
    return await async_whole_with_retry(raw, headers, upstream)


async def async_member_api(request: web.Request) -> web.StreamResponse:
    """The same on the public port, for members only."""
    if not _member(request):
        return api_error(403, "only members of this cluster may use its coordinator", "not_a_member", "auth_error")
    return await _to_coordinator(request, from_peer=True)


def _member(request: web.Request) -> bool:
    ip = request.remote or ""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(ip).is_loopback:
            return True
    return request.app[DOOR].is_member_address(ip)


async def async_member_events(request: web.Request) -> web.StreamResponse:
    """The coordinator's event stream on the public port (members only)."""
    if not _member(request):
        return api_error(403, "only members of this cluster may watch it", "not_a_member", "auth_error")
    t = request.app[DOOR].coordinator_target()
    if t is None or t.hub is None:
        return api_error(503, "this node does not coordinate the cluster", "not_coordinator")
    return await async_serve_events(request, t.hub)


async def async_relay_events(request: web.Request) -> web.WebSocketResponse:
    """The event stream on the local status API: the coordinator's, wherever it is, across
    elections (``coordinator_lost`` between two coordinators)."""
    door = request.app[DOOR]
    ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=64 * 1024)
    await ws.prepare(request)
    gone = asyncio.Event()

    async def watch_client() -> None:
        async for _ in ws:
            pass
        gone.set()

    watcher = asyncio.create_task(watch_client())
    last: str | None = None
    lost_said = False
    try:
        while not gone.is_set():
            t = door.coordinator_target()
            if t is not None:
                last = t.node
                if t.hub is not None:
                    await _relay_hub(ws, t.hub, door, gone)
                elif t.peer is not None and door.session is not None and door.transport is not None:
                    await _relay_peer(ws, t, door, gone)
                lost_said = False
            if gone.is_set() or ws.closed:
                break
            if not lost_said:
                await ws.send_str(CoordinatorLost(time.time(), last).to_json())
                lost_said = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gone.wait(), RECHECK_S)
    except (ConnectionError, RuntimeError):
        pass
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
        await ws.close()
    return ws


def _still(door: Door, t: Target) -> bool:
    """Whether ``t`` is still where the coordinator is."""
    now = door.coordinator_target()
    return now is not None and now.node == t.node and now.hub is t.hub and now.peer == t.peer


async def _relay_hub(ws: web.WebSocketResponse, hub: EventHub, door: Door, gone: asyncio.Event) -> None:
    """This node coordinates: its own hub, until it no longer does (or the client leaves).

    The next event is awaited by one future across the checks: cancelling a read at a check
    (``wait_for``'s timeout) could drop an event taken off the queue at that moment, and the
    hub's diffs come on the same 0.25 s beat as the checks."""
    sub = hub.subscribe()
    nxt = asyncio.ensure_future(sub.get())
    try:
        while not gone.is_set():
            done, _ = await asyncio.wait({nxt}, timeout=RECHECK_S)
            if not done:
                now = door.coordinator_target()
                if now is None or now.hub is not hub:
                    return
                continue
            try:
                ev = nxt.result()
            except HubClosed:
                return
            await ws.send_str(ev.to_json())
            nxt = asyncio.ensure_future(sub.get())
    finally:
        nxt.cancel()
        sub.close()


async def _relay_peer(ws: web.WebSocketResponse, t: Target, door: Door, gone: asyncio.Event) -> None:
    """Another node coordinates: pass its stream on until it breaks or that node no longer
    coordinates (a stream from a deposed coordinator must not be taken for the cluster's)."""
    assert t.peer is not None and door.session is not None and door.transport is not None
    try:
        async with door.session.ws_connect(
            door.transport.url(t.peer, "/v1/cluster/events"),
            heartbeat=HEARTBEAT_S,
            max_msg_size=MAX_EVENT_BYTES,
            timeout=aiohttp.ClientWSTimeout(ws_close=2.0),
        ) as up:
            ended = asyncio.ensure_future(gone.wait())
            nxt = asyncio.ensure_future(up.receive())
            try:
                while _still(door, t):
                    done, _ = await asyncio.wait({nxt, ended}, timeout=RECHECK_S, return_when=asyncio.FIRST_COMPLETED)
                    if ended in done:
                        return
                    if nxt not in done:
                        continue  # nothing new: check that it still coordinates
                    m = nxt.result()
                    if m.type != aiohttp.WSMsgType.TEXT:
                        return
                    await ws.send_str(m.data)
                    nxt = asyncio.ensure_future(up.receive())
            finally:
                ended.cancel()
                nxt.cancel()
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        log.debug("event stream of %s: %s", t.peer, e)
        await asyncio.sleep(RECHECK_S)


# the coordinator's OpenAI-compatible routes, forwarded (a model id may hold a slash)
API_ROUTES = (
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model:.+}"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
)


def add_member_routes(app: web.Application, door: Door) -> None:
    """The coordinator's services on an agent's public port (used by other members' agents)."""
    app[DOOR] = door
    app.router.add_get("/v1/cluster/events", async_member_events)
    for method, path in API_ROUTES:
        app.router.add_route(method, path, async_member_api)


def add_local_routes(app: web.Application, door: Door) -> None:
    """The same on the local status API (127.0.0.1), wherever the coordinator is. Added after the
    local API's own ``/v1/models/...`` routes (``/v1/models/pulls``): the first match wins."""
    app[DOOR] = door
    app.router.add_get("/v1/cluster/events", async_relay_events)
    for method, path in API_ROUTES:
        app.router.add_route(method, path, async_local_api)


def describe(t: Target | None) -> dict[str, Any]:
    if t is None:
        return {"node": None, "here": False, "ready": False}
    return {"node": t.node, "here": t.peer is None, "ready": t.peer is not None or t.api is not None}
