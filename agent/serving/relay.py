"""The relay of one agent's stage: frames to the compute thread, results on to the next hop.

Frames from any peer (the coordinator, the previous stage) are computed in arrival order on
the stage's compute thread (:mod:`agent.serving.stage_worker`), which also encodes the output
frame; the event loop only sends results on. A frame that fails validation is answered with
an ``Error`` on the connection it came from and, when it belongs to a stream, the error also
travels on along the ring so the coordinator learns of it; other streams are never touched.
A last stage may leave part of the vocabulary head to stage 0 (the split head): the relay
sends the hidden state back to stage 0 and combines both parts when they are in. A paged
stage also takes micro-batches (``Batch``: many streams' parts, one step, one frame on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from agent.protocol import (
    Batch,
    Close,
    Error,
    Fwd,
    Head,
    HeadTop,
    Message,
    Passed,
    Ping,
    Pong,
    ProtocolError,
    decode,
    encode,
)
from agent.security.transport import Transport
from agent.serving import frametrace
from agent.serving.link import Link, LinkClosed
from agent.serving.owners import Owners
from agent.serving.paged_worker import RETRYABLE, BatchOut
from agent.serving.stage_host import StageHost
from agent.serving.stage_worker import HeadWait, finish

log = logging.getLogger(__name__)

# Frames from outside the current term must not touch any stream (fencing).
FENCED = frozenset({"stale_term", "unknown_term", "not_assigned", "not_coordinator", "not_owner"})
MAX_PENDING = 512  # frames queued for the compute thread before new ones are refused
PROBE_S = 1.0  # how often a stage times the round trip to its next agent
HEAD_TIMEOUT_S = 60.0  # how long a last stage waits for stage 0's part of the head
HEAD_SEND_WAIT_S = 0.005  # how long its compute thread waits for that request to be on the socket
Key = tuple[str, int]  # (stream, seq)
# a step's result: the frame for the next hop, the ring's next step (its payload and frame)
Work = tuple[bytes, Fwd | None, bytes, bytes | None] | HeadWait


class StageRelay:
    """The compute queue and the next-hop link of one agent.

    Frames go straight to the compute thread in arrival order, which also encodes the
    output frame; the event loop only sends results on. Close and Error frames take the
    same queue, so they reach a stream after every step sent before them.
    """

    def __init__(self, host: StageHost, *, transport: Transport) -> None:
        self.host = host
        self.transport = transport  # how its links reach the next agent and stage 0
        self.next: Link | None = None
        self.loop: Link | None = None  # last stage -> stage 0, for steps the ring runs on its own
        self.pending = 0
        self._tasks: set[asyncio.Task[None]] = set()
        # steps waiting for stage 0's part of the head, and parts that came before their step
        self._heads: dict[Key, tuple[HeadWait, asyncio.TimerHandle]] = {}
        self._tops: dict[Key, HeadTop] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._prober: asyncio.Task[None] | None = None
        self.owners = Owners()  # which connection each stream belongs to
        self.loops: set[web.WebSocketResponse] = set()  # connections that are a last stage's link back here
        host.worker.loop_up = lambda: self.loop is not None and not self.loop.closed

    async def async_set_next(self, url: str, delay_ms: float, mbps: float = 0.0) -> None:
        link = Link(url, transport=self.transport, delay_ms=delay_ms, mbps=mbps, on_frame=self._on_next_reply)
        old, self.next = self.next, link
        if old is not None:
            await old.async_close()
        await self.next.async_connect()
        self.host.next_rtt_ms = None
        if self._prober is None or self._prober.done():
            self._prober = asyncio.create_task(self._probe())

    async def _probe(self) -> None:
        """Time the round trip to the next agent of the ring (node maps show it on the link):
        the link back to stage 0 for a last stage, else the next stage (not the coordinator)."""
        while True:
            await asyncio.sleep(PROBE_S)
            link = self.loop if self.loop is not None else self.next
            if link is None or link.closed or (link is self.next and link.url.endswith("/ring")):
                continue
            with contextlib.suppress(LinkClosed):
                link.send_nowait(encode(Ping(sent=time.monotonic())))

    def _pong(self, msg: Pong) -> None:
        rtt = (time.monotonic() - msg.sent) * 1000
        if 0 <= rtt < 60_000:
            old = self.host.next_rtt_ms
            self.host.next_rtt_ms = rtt if old is None else 0.7 * old + 0.3 * rtt

    async def async_set_loop(self, url: str | None, delay_ms: float, mbps: float = 0.0) -> None:
        old, self.loop = self.loop, None
        if old is not None:
            await old.async_close()
        if url:
            self.loop = Link(
                url, transport=self.transport, delay_ms=delay_ms, mbps=mbps, on_frame=self._on_loop_reply, role="loop"
            )
            await self.loop.async_connect()

    async def _on_next_reply(self, frame: bytes) -> None:
        # The next hop answers only with errors about frames we forwarded; they also went on
        # along the ring to the coordinator, so they are only logged here.
        with contextlib.suppress(ProtocolError):
            msg, _ = decode(frame)
            if isinstance(msg, Pong):
                self._pong(msg)
                return
            quiet = isinstance(msg, Error) and msg.code == "unknown_stream" and msg.stream in self.host.worker.closed
            log.log(logging.DEBUG if quiet else logging.INFO, "next hop reported: %s", msg)

    async def _on_loop_reply(self, frame: bytes) -> None:
        """Stage 0 answers the last stage with its part of the head (or an error about a step)."""
        try:
            msg, _ = decode(frame)
        except ProtocolError as e:
            log.info("stage 0 sent a bad frame: %s", e)
            return
        if isinstance(msg, HeadTop):
            frametrace.mark("head_top", msg.stream, msg.seq)
            key = (msg.stream, msg.seq)
            if key in self._heads:
                self._combine(key, msg)
            else:  # before this stage's own part: it is still computing
                self._tops[key] = msg
                while len(self._tops) > 64:
                    self._tops.pop(next(iter(self._tops)))
        elif isinstance(msg, Error) and (failed := self._heads.pop((msg.stream or "", msg.seq or -1), None)):
            failed[1].cancel()
            self.spawn(self.report(ProtocolError(msg.code, f"stage 0: {msg.message}", msg.stream, msg.seq), None))
        else:
            await self._on_next_reply(frame)

    def _wait_head(self, wait: HeadWait) -> None:
        """This stage's part of the head is done: combine with stage 0's, now or when it comes."""
        key = (wait.fwd.stream, wait.fwd.seq)
        assert self._aloop is not None
        wait.done_at = time.monotonic()
        timer = self._aloop.call_later(HEAD_TIMEOUT_S, self._head_timeout, key)
        self._heads[key] = (wait, timer)
        top = self._tops.pop(key, None)
        if top is not None:
            self._combine(key, top)

    def _head_timeout(self, key: Key) -> None:
        if self._heads.pop(key, None) is not None:
            err = ProtocolError("head_timeout", "stage 0 did not answer with its part of the head", *key)
            self.spawn(self.report(err, None))

    def _combine(self, key: Key, top: HeadTop) -> None:
        """The step's token: stage 0's rows come first, so on a tie its id wins (as argmax's)."""
        wait, timer = self._heads.pop(key)
        timer.cancel()
        self.host.worker.note_head_round((time.monotonic() - wait.done_at) * 1000, wait.gain_ms)
        assert wait.top is not None
        values, ids = wait.top
        if len(top.ids) != len(ids):
            self.spawn(self.report(ProtocolError("bad_field", "stage 0's head part has the wrong length", *key), None))
            return
        pairs = zip(top.ids, top.values, values, ids, strict=True)
        toks = tuple(lo if lv >= float(v) else int(i) for lo, lv, v, i in pairs)
        out = finish(wait.fwd, toks, wait.busy_ms)
        if out.follow is not None:
            self._continue(out.follow, out.follow_payload, encode(out.follow, out.follow_payload))
        self._send(encode(out.message, out.payload))

    def submit_head(self, msg: Head, payload: memoryview, reply: web.WebSocketResponse) -> None:
        """Stage 0: compute its rows of the head for the last stage, and answer on its connection."""

        def done(res: HeadTop | None, exc: BaseException | None) -> None:
            frametrace.mark("head_done", msg.stream, msg.seq)
            if res is not None:
                self.spawn(self._tell(reply, res))
            elif exc is not None:
                e = exc if isinstance(exc, ProtocolError) else ProtocolError("internal", str(exc), msg.stream, msg.seq)
                self.host.errors += 1
                log.info("head part failed: %s", e)
                self.spawn(self._tell(reply, Error(code=e.code, message=str(e), stream=msg.stream, seq=msg.seq)))

        self.host.compute.submit(self.host.worker.head_part, (msg, payload), done)

    def clear_heads(self) -> None:
        for _, timer in self._heads.values():
            timer.cancel()
        self._heads.clear()
        self._tops.clear()

    def submit_fwd(self, fwd: Fwd, payload: memoryview, reply: web.WebSocketResponse | None) -> None:
        if self.pending >= MAX_PENDING:
            self.spawn(self.report(ProtocolError("busy", "stage queue is full", fwd.stream, fwd.seq), reply))
            return
        self.pending += 1
        self._aloop = asyncio.get_running_loop()

        def done(res: Work | None, exc: BaseException | None) -> None:
            self.pending -= 1
            frametrace.mark("done", fwd.stream, fwd.seq)
            if isinstance(res, HeadWait):
                self._wait_head(res)
            elif exc is None and res is not None:
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

    def _work(self, fwd: Fwd, payload: memoryview) -> Work:
        """On the compute thread: run the stage, encode what goes to the next hop (and back to
        stage 0, where the ring runs the stream on its own and stage 0 is another agent).
        A step whose head is split sends its hidden states to stage 0 first, then computes this
        stage's part of the head while stage 0 computes the other."""
        frametrace.mark("start", fwd.stream, fwd.seq)
        out = self.host.worker.process(fwd, payload)
        if isinstance(out, HeadWait):
            frametrace.mark("trunk", fwd.stream, fwd.seq)
            frame = encode(Head(term=fwd.term, stream=fwd.stream, seq=fwd.seq, n=1), out.hidden)
            assert self._aloop is not None
            sent = threading.Event()
            self._aloop.call_soon_threadsafe(self._send_head, frame, fwd, sent)
            # On a node of one core the event loop would wait for this thread's next inference
            # to finish before it could send the frame: let it go first (bounded, in case not).
            sent.wait(HEAD_SEND_WAIT_S)
            frametrace.mark("head_sent", fwd.stream, fwd.seq)
            self.host.worker.head_own_part(out)
            frametrace.mark("end", fwd.stream, fwd.seq)
            return out
        frametrace.mark("end", fwd.stream, fwd.seq)
        follow_frame = None
        if out.follow is not None and not (self.host.worker.stage is not None and self.host.worker.stage.first):
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

    def _send_head(self, frame: bytes, fwd: Fwd, sent: threading.Event) -> None:
        if self.loop is not None and not self.loop.closed:
            self.loop.send_nowait(frame, sent)
        else:  # the link went down since the step started: the step fails (its timer reports it)
            sent.set()
            log.warning("no link back to stage 0 for the head of stream %s", fwd.stream)

    def submit_batch(self, msg: Batch, payload: memoryview, reply: web.WebSocketResponse) -> None:
        """A micro-batch for a paged stage: each part is admitted as a Fwd of its stream would be
        (a refused part is answered with an Error naming its stream, and dropped); the rest is
        one step on the compute thread, whose result goes on as one frame."""
        keep: list[int] = []
        for i, part in enumerate(msg.parts):
            try:
                self.host.worker.check_term(msg.term)
                if self.host.worker.paged is None:  # (checked again on the compute thread)
                    raise ProtocolError("unexpected", "this stage runs stateful attention: it takes Fwd frames")
                self.owners.admit_part(part, reply, reply in self.loops)
            except ProtocolError as e:
                e.stream, e.seq = part.stream, part.seq
                self.spawn(self.report(e, reply))
                continue
            keep.append(i)
        if not keep:
            return
        if self.pending >= MAX_PENDING:
            for i in keep:
                p = msg.parts[i]
                self.spawn(self.report(ProtocolError("busy", "stage queue is full", p.stream, p.seq), reply))
            return
        self.pending += 1

        def done(res: BatchOut | None, exc: BaseException | None) -> None:
            self.pending -= 1
            if res is None:
                log.error("stage failed on a micro-batch: %r", exc)
                res = BatchOut(
                    None, [ProtocolError("internal", str(exc), msg.parts[i].stream, msg.parts[i].seq) for i in keep]
                )
            for e in res.failed:
                self.spawn(self.report(e, reply))
            if res.frame is not None:
                self._send(res.frame)

        self.host.compute.submit(self.host.worker.process_batch, (msg, payload, keep), done)

    def submit_end(self, msg: Close | Error) -> None:
        """Forget the stream (after its queued steps) and pass the message along the ring."""

        def work() -> bytes:
            if msg.stream:
                self.host.worker.close_stream(msg.stream)
            return encode(msg)

        self.host.compute.submit(work, (), lambda frame, exc: self._send(frame) if exc is None else None)

    def _send(self, frame: bytes) -> None:
        if self.next is None or self.next.closed:
            log.warning("no next hop: dropping a frame")
            return
        self.next.send_nowait(frame)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` in a task that lives as long as this relay (cancelled when it closes)."""
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
        ended = e.code == "unknown_stream" and e.stream in self.host.worker.closed
        stage = self.host.assignment.stage if self.host.assignment else None
        err = Error(code=e.code, message=str(e), stream=e.stream, seq=e.seq, stage=stage)
        if ended:
            log.debug("a step of ended stream %s", e.stream)
        else:
            self.host.errors += 1
            log.info("refused a frame: %s", err)
        if reply is not None:
            await self._tell(reply, err)
        # A part that found no room on stage 0 changed nothing anywhere: the sender (the
        # coordinator) may send it again. Further on, earlier stages have computed it: it fails.
        retry = e.code in RETRYABLE and stage == 0 and reply is not None and reply not in self.loops
        if (
            e.stream is not None
            and self.host.assignment is not None
            and e.code not in FENCED
            and not ended
            and not retry
            and self.owners.may_fail(e.stream, reply, reply in self.loops)
        ):
            # the stream's request has failed: free it here and tell the rest of the ring
            # (only a frame from the stream's own sender can fail it: never another connection's)
            self.submit_end(err)

    async def async_close(self) -> None:
        tasks = [t for t in (self._prober, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in (self.next, self.loop):
            if link is not None:
                await link.async_close()
        self.host.shutdown()
