"""The agent's aiohttp server: the stage websocket (``/ws``) and the local status API.

Frames from any peer (the coordinator, the previous stage) are computed in arrival order on
the stage's compute thread. Results go straight to the next hop.
A frame that fails validation is answered with an ``Error`` on the connection it came from
and, when it belongs to a stream, the error also travels on along the ring so the
coordinator learns of it; other streams are never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import aiohttp
from aiohttp import web

from agent import frametrace
from agent.link import HEARTBEAT_S, Link
from agent.protocol import MAX_FRAME, Assign, Close, Error, Fwd, Message, Passed, ProtocolError, decode, encode
from agent.stage_host import Output, StageHost

log = logging.getLogger(__name__)

HOST = web.AppKey("host", StageHost)
# Frames from outside the current term must not touch any stream (fencing).
FENCED = frozenset({"stale_term", "unknown_term", "not_assigned"})


MAX_PENDING = 512  # frames queued for the compute thread before new ones are refused


class AgentRuntime:
    """The compute queue and the next-hop link of one agent.

    Frames go straight to the compute thread in arrival order, which also encodes the
    output frame; the event loop only sends results on. Close and Error frames take the
    same queue, so they reach a stream after every step sent before them.
    """

    def __init__(self, host: StageHost) -> None:
        self.host = host
        self.next: Link | None = None
        self.loop: Link | None = None  # last stage -> stage 0, for steps the ring runs on its own
        self.pending = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def async_set_next(self, url: str, delay_ms: float, mbps: float = 0.0) -> None:
        old, self.next = self.next, Link(url, delay_ms=delay_ms, mbps=mbps, on_frame=self._on_next_reply)
        if old is not None:
            await old.async_close()
        await self.next.async_connect()

    async def async_set_loop(self, url: str | None, delay_ms: float, mbps: float = 0.0) -> None:
        old, self.loop = self.loop, None
        if old is not None:
            await old.async_close()
        if url:
            self.loop = Link(url, delay_ms=delay_ms, mbps=mbps, on_frame=self._on_next_reply)
            await self.loop.async_connect()

    async def _on_next_reply(self, frame: bytes) -> None:
        # The next hop answers only with errors about frames we forwarded; they also went on
        # along the ring to the coordinator, so they are only logged here.
        with contextlib.suppress(ProtocolError):
            msg, _ = decode(frame)
            quiet = isinstance(msg, Error) and msg.code == "unknown_stream" and msg.stream in self.host.closed
            log.log(logging.DEBUG if quiet else logging.INFO, "next hop reported: %s", msg)

    def submit_fwd(self, fwd: Fwd, payload: memoryview, reply: web.WebSocketResponse | None) -> None:
        if self.pending >= MAX_PENDING:
            self.spawn(self.report(ProtocolError("busy", "stage queue is full", fwd.stream, fwd.seq), reply))
            return
        self.pending += 1

        def done(res: tuple[bytes, Fwd | None, bytes, bytes | None] | None, exc: BaseException | None) -> None:
            self.pending -= 1
            frametrace.mark("done", fwd.stream, fwd.seq)
            if exc is None and res is not None:
                if fwd.ack and reply is not None:  # the sender waits to hear it has passed stage 0
                    self.spawn(self._tell(reply, Passed(term=fwd.term, stream=fwd.stream, seq=fwd.seq)))
                frame, follow, follow_payload, follow_frame = res
                if follow is not None:  # the ring's next step first: stage 0 waits for it
                    self._continue(follow, follow_payload, follow_frame)
                self._send(frame)
            elif isinstance(exc, ProtocolError):
                self.spawn(self.report(exc, reply))
            else:
                log.error("stage failed on stream %s: %r", fwd.stream, exc)
                self.spawn(self.report(ProtocolError("internal", str(exc), fwd.stream, fwd.seq), reply))

        self.host.compute.submit(self._work, (fwd, payload), done)

    def _work(self, fwd: Fwd, payload: memoryview) -> tuple[bytes, Fwd | None, bytes, bytes | None]:
        """On the compute thread: run the stage, encode what goes to the next hop (and back to
        stage 0, where the ring runs the stream on its own and stage 0 is another agent)."""
        frametrace.mark("start", fwd.stream, fwd.seq)
        out: Output = self.host.process(fwd, payload)
        frametrace.mark("end", fwd.stream, fwd.seq)
        follow_frame = None
        if out.follow is not None and not (self.host.stage is not None and self.host.stage.first):
            follow_frame = encode(out.follow, out.follow_payload)
        return encode(out.message, out.payload), out.follow, out.follow_payload, follow_frame

    def _continue(self, follow: Fwd, payload: bytes, frame: bytes | None) -> None:
        """The ring runs the stream's next step on its own: back to stage 0."""
        if frame is None:  # a one-stage ring: stage 0 is right here
            self.submit_fwd(follow, memoryview(payload), None)
        elif self.loop is not None and not self.loop.closed:
            self.loop.send_nowait(frame)
        else:
            log.warning("no link back to stage 0: stream %s stops here", follow.stream)

    def submit_end(self, msg: Close | Error) -> None:
        """Forget the stream (after its queued steps) and pass the message along the ring."""

        def work() -> bytes:
            if msg.stream:
                self.host.close_stream(msg.stream)
            return encode(msg)

        self.host.compute.submit(work, (), lambda frame, exc: self._send(frame) if exc is None else None)

    def _send(self, frame: bytes) -> None:
        if self.next is None or self.next.closed:
            log.warning("no next hop: dropping a frame")
            return
        self.next.send_nowait(frame)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` in a task that lives as long as this runtime (cancelled when it closes)."""
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _tell(self, ws: web.WebSocketResponse, msg: Message) -> None:
        """Answer the frame's sender on its own connection (unless it has gone)."""
        if not ws.closed:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.send_bytes(encode(msg))

    async def report(self, e: ProtocolError, reply: web.WebSocketResponse | None) -> None:
        # a step the ring was still running when its stream ended: nobody waits for it
        ended = e.code == "unknown_stream" and e.stream in self.host.closed
        stage = self.host.assignment.stage if self.host.assignment else None
        err = Error(code=e.code, message=str(e), stream=e.stream, seq=e.seq, stage=stage)
        if ended:
            log.debug("a step of ended stream %s", e.stream)
        else:
            self.host.errors += 1
            log.info("refused a frame: %s", err)
        if reply is not None:
            await self._tell(reply, err)
        if e.stream is not None and self.host.assignment is not None and e.code not in FENCED and not ended:
            # the stream's request has failed: free it here and tell the rest of the ring
            self.submit_end(err)

    async def async_close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for link in (self.next, self.loop):
            if link is not None:
                await link.async_close()
        self.host.shutdown()


RUNTIME = web.AppKey("runtime", AgentRuntime)


async def ws_handler(request: web.Request) -> web.WebSocketResponse:
    rt = request.app[RUNTIME]
    ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=MAX_FRAME, compress=False)
    await ws.prepare(request)
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
                behind = rt.spawn(_in_turn(behind, _on_frame(rt, ws, msg, payload)))
        elif m.type == aiohttp.WSMsgType.TEXT:
            await rt.report(ProtocolError("bad_frame", "frames must be binary"), ws)
        elif m.type == aiohttp.WSMsgType.ERROR:
            log.info("websocket error: %s", ws.exception())
    return ws


async def _in_turn(before: asyncio.Task[None] | None, handle: Coroutine[Any, Any, None]) -> None:
    if before is not None:
        await asyncio.wait([before])
    await handle


async def _on_frame(rt: AgentRuntime, ws: web.WebSocketResponse, msg: Message, payload: memoryview) -> None:
    try:
        if isinstance(msg, Fwd):
            frametrace.mark("recv", msg.stream, msg.seq)
            rt.host.check_term(msg.term)
            rt.submit_fwd(msg, payload, ws)
        elif isinstance(msg, Assign):
            assigned = await rt.host.async_assign(msg)
            await rt.async_set_next(msg.next_hop, msg.link_delay_ms, msg.link_mbps)
            loop_hop = msg.loop_hop if msg.stage == msg.stages - 1 and msg.stages > 1 else None
            await rt.async_set_loop(loop_hop, msg.link_delay_ms, msg.link_mbps)
            try:
                await ws.send_bytes(encode(assigned))
            except (ConnectionError, RuntimeError):  # the coordinator left while the stage was set up
                log.info("stage %d of term %d ready, but the coordinator that assigned it is gone", msg.stage, msg.term)
        elif isinstance(msg, Close | Error):
            rt.submit_end(msg)
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


def make_app(host: StageHost, status: Callable[[], dict[str, Any]] | None = None) -> web.Application:
    """The public app: the stage websocket and a read-only ``/v1/node`` (``status`` or the stage's)."""
    app = web.Application(client_max_size=MAX_FRAME)
    app[HOST] = host
    app[STATUS] = status or host.status
    app.router.add_get("/ws", ws_handler)
    app.router.add_get("/v1/node", node_handler)

    async def runtime_ctx(app: web.Application) -> AsyncIterator[None]:
        rt = AgentRuntime(app[HOST])
        app[RUNTIME] = rt
        yield
        await rt.async_close()

    app.cleanup_ctx.append(runtime_ctx)
    return app
