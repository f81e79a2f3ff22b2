"""The agent's aiohttp server: the stage websocket (``/ws``) and the local status API.

Each connection's frames are read in arrival order and handed to the agent's
:class:`~agent.serving.relay.StageRelay`, which computes them on the stage's compute thread
and sends results on to the next hop; an assignment (a download, a compile) runs in a task so
that the connection keeps answering its heartbeat meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from agent.common.http import json_errors
from agent.protocol import (
    MAX_FRAME,
    Assign,
    Batch,
    Close,
    Error,
    Fwd,
    Head,
    Message,
    Ping,
    Pong,
    ProtocolError,
    decode,
    encode,
)
from agent.security.transport import TRANSPORT_KEY, Transport
from agent.serving import frametrace
from agent.serving.link import HEARTBEAT_S
from agent.serving.owners import LINK_HEADER
from agent.serving.relay import StageRelay
from agent.serving.stage_host import StageHost

log = logging.getLogger(__name__)

HOST = web.AppKey("host", StageHost)
# who may assign: (the assignment's term, the peer's node id from its certificate) -> None or
# ProtocolError (agent.cluster.fencing; elected agents with credentials)
Fence = Callable[[int, str | None], Awaitable[None]]
FENCE: web.AppKey[Fence | None] = web.AppKey("fence")
RELAY = web.AppKey("relay", StageRelay)


async def ws_handler(request: web.Request) -> web.WebSocketResponse:
    rt = request.app[RELAY]
    ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=MAX_FRAME, compress=False)
    await ws.prepare(request)
    if request.headers.get(LINK_HEADER) == "loop":
        rt.loops.add(ws)
    try:
        return await _serve(rt, ws, request.app[FENCE], request.get("peer"))
    finally:
        rt.loops.discard(ws)
        a = rt.host.assignment
        for stream in rt.owners.release(ws):  # its streams end with it
            if a is not None:
                rt.submit_end(Close(term=a.term, stream=stream))


async def _serve(
    rt: StageRelay, ws: web.WebSocketResponse, fence: Fence | None, peer: str | None
) -> web.WebSocketResponse:
    # Frames are handled in arrival order. An assignment may take minutes (a download, a cold
    # compile): it, and any frame after it on this connection, runs in a task, so that this loop
    # keeps reading, which is what answers the peer's heartbeat pings meanwhile.
    behind: asyncio.Task[None] | None = None
    async for m in ws:
        if m.type == aiohttp.WSMsgType.BINARY:
            try:
                msg, payload = decode(m.data)
            except ProtocolError as e:
                await rt.report(e, ws)
                continue
            if (behind is None or behind.done()) and not isinstance(msg, Assign):
                await _on_frame(rt, ws, msg, payload)
            else:
                behind = rt.spawn(_in_turn(behind, _on_frame(rt, ws, msg, payload, fence, peer)))
        elif m.type == aiohttp.WSMsgType.TEXT:
            await rt.report(ProtocolError("bad_frame", "frames must be binary"), ws)
        elif m.type == aiohttp.WSMsgType.ERROR:
            log.info("websocket error: %s", ws.exception())
    return ws


async def _in_turn(before: asyncio.Task[None] | None, handle: Coroutine[Any, Any, None]) -> None:
    if before is not None:
        await asyncio.wait([before])
    await handle


async def _on_frame(
    rt: StageRelay,
    ws: web.WebSocketResponse,
    msg: Message,
    payload: memoryview,
    fence: Fence | None = None,
    peer: str | None = None,
) -> None:
    try:
        if isinstance(msg, Fwd):
            frametrace.mark("recv", msg.stream, msg.seq)
            rt.host.worker.check_term(msg.term)
            rt.owners.admit_fwd(msg, ws, ws in rt.loops)
            rt.submit_fwd(msg, payload, ws)
        elif isinstance(msg, Batch):
            frametrace.mark("batch_recv", "-", msg.seq)
            rt.submit_batch(msg, payload, ws)
        elif isinstance(msg, Head):
            frametrace.mark("head_recv", msg.stream, msg.seq)
            rt.host.worker.check_term(msg.term)
            rt.submit_head(msg, payload, ws)
        elif isinstance(msg, Assign):
            if fence is not None:  # only the coordinator elected for its term (before anything changes)
                await fence(msg.term, peer)
            assigned = await rt.host.async_assign(msg)
            rt.owners.clear()  # the new stage holds no stream yet
            rt.clear_heads()
            await rt.async_set_next(msg.next_hop, msg.link_delay_ms, msg.link_mbps)
            loop_hop = msg.loop_hop if msg.stage == msg.stages - 1 and msg.stages > 1 else None
            await rt.async_set_loop(loop_hop, msg.link_delay_ms, msg.link_mbps)
            try:
                await ws.send_bytes(encode(assigned))
            except (ConnectionError, RuntimeError):  # the coordinator left while the stage was set up
                log.info("stage %d of term %d ready, but the coordinator that assigned it is gone", msg.stage, msg.term)
        elif isinstance(msg, Close | Error):
            if rt.owners.admit_end(msg, ws):
                rt.submit_end(msg)
        elif isinstance(msg, Ping):  # the previous stage times its link to us
            await ws.send_bytes(encode(Pong(sent=msg.sent)))
        else:
            raise ProtocolError("unexpected", f"an agent does not accept {msg.TYPE!r} frames")
    except ProtocolError as e:
        await rt.report(e, ws)
    except Exception as e:
        log.exception("frame handling failed")
        await rt.report(ProtocolError("internal", str(e)), ws)


StatusFn = Callable[[], dict[str, Any]]
STATUS: web.AppKey[StatusFn] = web.AppKey("status")


async def node_handler(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATUS]())


def make_app(
    host: StageHost,
    transport: Transport,
    status: Callable[[], dict[str, Any]] | None = None,
    middlewares: Sequence[Any] = (),
    fence: Fence | None = None,
) -> web.Application:
    """The public app: the stage websocket and a read-only ``/v1/node`` (``status`` or the stage's);
    ``transport``: what its port serves and its links use (the app's ``TRANSPORT_KEY``, which
    :func:`agent.security.transport.peer_middleware` reads); ``fence``: who may assign this agent
    a stage (None: anyone who reaches it, in a newer term)."""
    app = web.Application(client_max_size=MAX_FRAME, middlewares=[json_errors, *middlewares])
    app[TRANSPORT_KEY] = transport
    app[FENCE] = fence
    app[HOST] = host
    app[STATUS] = status or host.status
    app.router.add_get("/ws", ws_handler)
    app.router.add_get("/v1/node", node_handler)

    async def relay_ctx(app: web.Application) -> AsyncIterator[None]:
        rt = StageRelay(app[HOST], transport=app[TRANSPORT_KEY])
        app[RELAY] = rt
        yield
        await rt.async_close()

    app.cleanup_ctx.append(relay_ctx)
    return app
