"""The coordinator's end of the ring: assign stages, send steps to stage 0, collect ids.

``coordinator --fwd--> stage 0 --fwd--> ... --> stage N-1 --ids--> coordinator``

Each step of a stream is one ``Fwd`` frame carrying token ids; the last stage answers with an
``Ids`` frame on the coordinator's return websocket. Many streams can be in flight at once:
that is what keeps every stage busy (micro-batching). A step's tokens come back as a
:class:`Chosen` (a tuple of ids), with their log-probabilities when its sampling asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from agent.common.hashing import sha256_file
from agent.protocol import (
    MAX_FRAME,
    Assign,
    Assigned,
    Batch,
    BatchIds,
    Close,
    Error,
    Fwd,
    Ids,
    Passed,
    ProtocolError,
    SamplingSpec,
    TokenLogprobs,
    decode,
    encode,
)
from agent.protocol.batch import Part
from agent.protocol.logprobs import LOGPROB_FLOOR, from_arrays
from agent.runtime.sampling import token_logprobs
from agent.security.errors import SecurityError
from agent.security.transport import Transport
from agent.serving.link import HEARTBEAT_S, Link, LinkClosed

log = logging.getLogger(__name__)


class PipelineError(RuntimeError):
    def __init__(self, message: str, code: str = "pipeline", retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after  # seconds a client should wait before asking again (None: not said)


@dataclass(frozen=True)
class RingCapacity:
    """What every stage of a paged pipeline holds: the micro-batching scheduler's ledger."""

    total_blocks: int  # KV blocks of the smallest pool, in blocks of ``block_size`` tokens
    block_size: int
    token_budget: int  # rows one stage step takes (the smallest step budget)


class Chosen(tuple[int, ...]):
    """A step's tokens as the last stage chose them (a tuple of ids, equal to any tuple of the
    same ids), with ``logprobs``: one per token when the step's sampling asked (else None)."""

    logprobs: tuple[TokenLogprobs, ...] | None

    def __new__(cls, tokens: Iterable[int], logprobs: tuple[TokenLogprobs, ...] | None = None) -> Chosen:
        self = super().__new__(cls, tokens)
        if logprobs is not None and len(logprobs) != len(self):
            raise ValueError(f"{len(logprobs)} log-probabilities for {len(self)} tokens")
        self.logprobs = logprobs
        return self


def logprobs_of(toks: Sequence[int]) -> tuple[TokenLogprobs, ...] | None:
    """The log-probabilities that came with a step's tokens (None: not asked, or a plain tuple)."""
    return toks.logprobs if isinstance(toks, Chosen) else None


def last_logprobs(toks: Sequence[int]) -> TokenLogprobs | None:
    """The log-probabilities of a step's last token, if they came."""
    lps = logprobs_of(toks)
    return lps[-1] if lps else None


def run_token(item: tuple[int, ...] | PipelineError) -> int:
    """One item of a ring run's queue (see :meth:`Pipeline.async_run`) as its token; an error raises."""
    if isinstance(item, PipelineError):
        raise item
    return item[-1]


def run_step(item: tuple[int, ...] | PipelineError) -> tuple[int, TokenLogprobs | None]:
    """One item of a ring run's queue as its token and that token's log-probabilities (None:
    not asked); an error raises."""
    return run_token(item), last_logprobs(item) if not isinstance(item, PipelineError) else None


@dataclass(frozen=True)
class StagePlacement:
    node: str  # host:port of the agent
    stage_dir: Path
    device: str | None = None  # the device the planner chose on that agent (None: the agent's own)


class Pipeline:
    def __init__(
        self,
        placements: Sequence[StagePlacement],
        *,
        export_id: str,
        return_url: str,
        artifacts_url: str,
        transport: Transport,  # how it reaches its agents (and which certificates they must show)
        term: int = 1,
        link_delay_ms: float = 0.0,
        link_mbps: float = 0.0,
        home_first: bool = False,
        wire_dtype: str = "f16",
        exact: bool = False,
        ship_artifacts: bool = False,
    ) -> None:
        self.placements = list(placements)
        self.export_id = export_id
        self.return_url = return_url
        self.artifacts_url = artifacts_url.rstrip("/")
        self.transport = transport
        self.term = term
        self.link_delay_ms = link_delay_ms
        self.link_mbps = link_mbps
        self.home_first = home_first  # stage 0 runs on this machine: its hop is local (no WAN emulation)
        self.wire_dtype = wire_dtype
        self.exact = exact
        self.ship_artifacts = ship_artifacts  # never offer the local path: agents download
        self._session: aiohttp.ClientSession | None = None
        self._control: list[aiohttp.ClientWebSocketResponse] = []
        self._link: Link | None = None
        self._pending: dict[tuple[str, int], asyncio.Future[tuple[int, ...]]] = {}
        # steps whose logits come back (``ret_logits``) and that ask for log-probabilities: how many
        # alternatives (this end computes them from the logits)
        self._want_logprobs: dict[tuple[str, int], int] = {}
        self._batches: dict[int, asyncio.Future[BatchIds]] = {}  # micro-batches in flight, by seq
        # told of every error the ring reports for a stream (the micro-batching scheduler's parts)
        self.on_stream_error: Callable[[str, int | None, PipelineError], None] | None = None
        self._passed: dict[tuple[str, int], asyncio.Future[None]] = {}  # steps stage 0 is to confirm
        # per stream: the bottleneck stage's compute time of its latest step, in seconds
        self.busy_s: dict[str, float] = {}
        self._queues: dict[str, asyncio.Queue[tuple[int, ...] | PipelineError]] = {}
        self._seq = itertools.count()
        self.assigned: list[Assigned] = []
        self._watchers: list[asyncio.Task[None]] = []
        self._replies: list[asyncio.Future[bytes] | None] = []  # per stage: its assignment's reply, awaited
        self.lost: str | None = None  # the first agent found gone: the pipeline is broken
        self.paused: set[str] = set()  # agents that refused steps because they are paused
        self._closing = False

    # -- set-up ------------------------------------------------------------------------------
    async def async_start(self, timeout: float = 300.0) -> None:
        self._session = self.transport.session()
        n = len(self.placements)
        # Every control connection is read from the start: an agent that was assigned first must
        # have its heartbeat pings answered while the next one downloads and compiles its stage.
        self._replies = [None] * n
        for i, p in enumerate(self.placements):
            ws = await self._connect(p.node, timeout)
            self._control.append(ws)
            self._watchers.append(asyncio.create_task(self._watch_control(i, p.node, ws)))
        # Every stage at once (their downloads and compiles overlap); each connects to its next
        # hop, whose agent listens whether it has a stage yet or not.
        self.assigned = [None] * n  # type: ignore[list-item]
        tr = self.transport
        loop = asyncio.get_running_loop()
        for i in range(n):
            p = self.placements[i]
            nxt = tr.url(self.placements[i + 1].node, "/ws", ws=True) if i + 1 < n else self.return_url
            msg = Assign(
                term=self.term,
                export_id=self.export_id,
                stage=i,
                stages=n,
                manifest_sha256=sha256_file(p.stage_dir / "manifest.json"),
                artifacts_url=f"{self.artifacts_url}/{self.export_id}/{i}",
                local_dir=None if self.ship_artifacts else str(p.stage_dir),
                next_hop=nxt,
                wire_dtype=self.wire_dtype,
                exact=self.exact,
                link_delay_ms=self.link_delay_ms,
                link_mbps=self.link_mbps,
                loop_hop=tr.url(self.placements[0].node, "/ws", ws=True) if i == n - 1 and n > 1 else None,
                device=p.device,
            )
            self._replies[i] = loop.create_future()
            await self._control[i].send_bytes(encode(msg))
        for i in range(n):
            p, reply = self.placements[i], self._replies[i]
            assert reply is not None
            got, _ = decode(await asyncio.wait_for(reply, timeout))
            if isinstance(got, Error):
                raise PipelineError(f"agent {p.node} refused stage {i}: {got.message}", got.code)
            assert isinstance(got, Assigned)
            self.assigned[i] = got
            log.info("stage %d on %s (%s), ready in %.1fs", i, p.node, got.device, got.compile_s)
        if self.lost is not None:  # an agent assigned earlier died while a later one was set up
            raise PipelineError(f"the agent at {self.lost} is gone", "node_lost")
        first = tr.url(self.placements[0].node, "/ws", ws=True)
        wan = not self.home_first
        self._link = Link(
            first,
            transport=tr,
            delay_ms=self.link_delay_ms if wan else 0.0,
            mbps=self.link_mbps if wan else 0.0,
            on_frame=self.async_on_frame,
        )
        await self._link.async_connect()

    def replied(self, i: int) -> bool:
        """Whether stage ``i``'s agent has answered its assignment (its stage is ready, or refused)."""
        reply = self._replies[i] if i < len(self._replies) else None
        return reply is not None and reply.done()

    def capacity(self) -> RingCapacity | None:
        """The ring's KV pool and step budget when every stage is paged (None: some stage is
        stateful, or not assigned yet). Stages of unlike block sizes count in the largest."""
        if not self.assigned or not all(a is not None and a.paged for a in self.assigned):
            return None
        bs = max(a.block_tokens or 1 for a in self.assigned)
        total = min((a.kv_blocks or 0) * (a.block_tokens or 1) // bs for a in self.assigned)
        budget = min(a.step_tokens or 2048 for a in self.assigned)
        return RingCapacity(total, bs, budget) if total > 0 else None

    async def _connect(self, node: str, timeout: float) -> aiohttp.ClientWebSocketResponse:
        assert self._session is not None
        deadline = time.monotonic() + min(timeout, 60.0)
        while True:
            try:
                ws = await self._session.ws_connect(
                    self.transport.url(node, "/ws"), heartbeat=HEARTBEAT_S, max_msg_size=MAX_FRAME, compress=0
                )
            except (aiohttp.ClientError, OSError) as e:
                if time.monotonic() > deadline:
                    raise PipelineError(f"cannot reach the agent at {node}: {e}", "unreachable") from e
                await asyncio.sleep(0.2)
                continue
            try:
                self.transport.check_server(ws)
            except SecurityError as e:
                await ws.close()
                raise PipelineError(f"refusing the agent at {node}: {e}", "refused") from e
            return ws

    async def _watch_control(self, i: int, node: str, ws: aiohttp.ClientWebSocketResponse) -> None:
        """An agent's replies to its assignment, its errors, and its death: the control connection
        closes (or its heartbeat stops)."""
        async for m in ws:
            if m.type == aiohttp.WSMsgType.BINARY:
                reply = self._replies[i]
                if reply is not None and not reply.done():
                    reply.set_result(m.data)
                else:
                    await self.async_on_frame(m.data)
        reply = self._replies[i]
        if reply is not None and not reply.done():  # say why: a missed heartbeat, the agent's close code
            code = ws.close_code
            why = ws.exception() or (f"close code {code}" if code is not None else "closed")
            reply.set_exception(PipelineError(f"agent {node} closed the connection during assignment ({why})"))
        if not self._closing:
            self.mark_lost(node)

    def mark_lost(self, node: str, why: str | None = None) -> None:
        """An agent is gone (or the plan moved on): every stream in flight fails with ``node_lost``,
        which the scheduler answers by replaying the stream on the current pipeline."""
        if self.lost is not None:
            return
        self.lost = node
        why = why or f"the agent at {node} is gone"
        log.warning("pipeline stopped: %s", why)
        err = PipelineError(why, "node_lost")
        futs: list[asyncio.Future[Any]] = [*self._pending.values(), *self._batches.values()]
        for fut in futs:
            if not fut.done():
                fut.set_exception(err)
        for q in self._queues.values():
            q.put_nowait(err)

    # -- data path ---------------------------------------------------------------------------
    def new_stream(self) -> str:
        return uuid.uuid4().hex[:16]

    def send_step(
        self,
        stream: str,
        ids: Sequence[int],
        *,
        start: bool = False,
        rollback: int = 0,
        logits: Sequence[int] = (),
        sampling: SamplingSpec | None = None,
        ret_logits: bool = False,
        passed: asyncio.Future[None] | None = None,
    ) -> asyncio.Future[tuple[int, ...]]:
        """Send one step of ``stream`` into the ring now; the future gets the last stage's tokens.

        ``passed`` (optional) is resolved once stage 0 has computed the step (it is asked to say
        so), or else when the step's result or error comes back, whichever is first.

        ``ret_logits`` asks the last stage for logits instead of ids (the naive design, for
        the WAN comparison); the coordinator then picks the greedy tokens itself. The frame is
        on the wire when this returns.

        Several steps of one stream may be in flight: stages take them in order.
        Cancelling the future only stops waiting for it.
        """
        link = self._ready()
        seq = next(self._seq)
        key = (stream, seq)
        fut: asyncio.Future[tuple[int, ...]] = asyncio.get_running_loop().create_future()
        self._send_ids(
            link,
            stream,
            seq,
            ids,
            start=start,
            rollback=rollback,
            logits=tuple(logits),
            sampling=sampling or SamplingSpec(),
            ret_logits=ret_logits,
            ack=passed is not None,
        )
        self._pending[key] = fut
        fut.add_done_callback(lambda _: self._pending.pop(key, None))
        if ret_logits and sampling is not None and sampling.logprobs is not None:
            self._want_logprobs[key] = sampling.logprobs
            fut.add_done_callback(lambda _: self._want_logprobs.pop(key, None))
        if passed is not None:
            self._passed[key] = passed
            fut.add_done_callback(lambda _: _resolve(self._passed.pop(key, None)))
        return fut

    async def async_run(
        self,
        stream: str,
        ids: Sequence[int],
        *,
        start: bool,
        auto: int,
        stop: Sequence[int] = (),
        sampling: SamplingSpec | None = None,
        rollback: int = 0,
    ) -> asyncio.Queue[tuple[int, ...] | PipelineError]:
        """Send a step that the ring continues on its own for up to ``auto`` more tokens.

        Every token the last stage produces for ``stream`` (this step's, then the ring's own
        steps') arrives on the returned queue; an error arrives as a PipelineError. The queue
        lives until :meth:`end_run` or :meth:`async_close_stream`. Steps of the stream sent
        before it still resolve their own futures. When the run is over (``auto`` tokens after
        the first), the last token is the stream's pending one: the ring did not feed it.
        """
        link = self._ready()
        q: asyncio.Queue[tuple[int, ...] | PipelineError] = asyncio.Queue()
        self._queues[stream] = q
        self._send_ids(
            link,
            stream,
            next(self._seq),
            ids,
            start=start,
            sampling=sampling or SamplingSpec(),
            auto=auto,
            stop=tuple(stop),
            rollback=rollback,
        )
        return q

    def send_batch(self, parts: Sequence[Part], ids: Sequence[int]) -> asyncio.Future[BatchIds]:
        """Send one micro-batch (``parts``, and their token ids one part after another) into the
        ring now; the future gets the last stage's :class:`BatchIds`. A part a stage refuses is
        reported through :attr:`on_stream_error` and left out of the answer; when no part gets
        through, no answer comes (the scheduler counts the errors)."""
        link = self._ready()
        seq = next(self._seq)
        arr = np.asarray(ids, dtype=np.int32)
        msg = Batch(term=self.term, seq=seq, dtype="i32", parts=tuple(parts), sent_at=time.time())
        if msg.rows != arr.size:
            raise ValueError(f"{arr.size} ids for parts of {msg.rows} rows")
        fut: asyncio.Future[BatchIds] = asyncio.get_running_loop().create_future()
        try:
            link.send_nowait(encode(msg, arr.tobytes()))
        except LinkClosed as e:
            raise PipelineError(str(e), "node_lost") from e
        self._batches[seq] = fut
        fut.add_done_callback(lambda _: self._batches.pop(seq, None))
        return fut

    def close_stream_nowait(self, stream: str) -> None:
        """End ``stream`` on every stage (its KV blocks go back to the pools), in order with the
        frames sent before and after it."""
        if self._link is not None and not self._link.closed and self.lost is None:
            with contextlib.suppress(LinkClosed):
                self._link.send_nowait(encode(Close(term=self.term, stream=stream)))

    def end_run(self, stream: str) -> None:
        """The ring run of ``stream`` is over: its later steps resolve futures again."""
        self._queues.pop(stream, None)

    def _ready(self) -> Link:
        """The link to stage 0, if this pipeline can take work."""
        if self._link is None:
            raise PipelineError("the pipeline is not started")
        if self.lost is not None:
            raise PipelineError(f"the agent at {self.lost} is gone", "node_lost")
        return self._link

    def _send_ids(self, link: Link, stream: str, seq: int, ids: Sequence[int], **fields: Any) -> None:
        """One Fwd of token ids into the ring; a closed link means the first stage is gone."""
        arr = np.asarray(ids, dtype=np.int32)
        msg = Fwd(term=self.term, stream=stream, seq=seq, n=int(arr.size), dtype="i32", sent_at=time.time(), **fields)
        try:
            link.send_nowait(encode(msg, arr))
        except LinkClosed as e:
            raise PipelineError(str(e), "node_lost") from e

    async def async_close_stream(self, stream: str) -> None:
        self._queues.pop(stream, None)
        self.busy_s.pop(stream, None)
        if self._link is not None and not self._link.closed and self.lost is None:
            await self._link.async_send(encode(Close(term=self.term, stream=stream)))

    async def async_on_frame(self, frame: bytes, from_ring: bool = False) -> None:
        """A frame back from the ring (``from_ring``: on the return endpoint, which any node can
        reach), or an error from an agent this coordinator connected to."""
        try:
            msg, payload = decode(frame)
            if isinstance(msg, Ids) and msg.rows:
                logits = np.frombuffer(payload, dtype=np.float32)
                if logits.size != msg.rows * msg.vocab:
                    raise ProtocolError(
                        "bad_payload", "logits payload does not match rows x vocab", msg.stream, msg.seq
                    )
                rows = logits.reshape(msg.rows, msg.vocab)
                toks = tuple(int(t) for t in rows.argmax(axis=-1))
                top = self._want_logprobs.get((msg.stream, msg.seq))
                lps = None if top is None else from_arrays(*token_logprobs(rows, toks, top, LOGPROB_FLOOR))
                msg = Ids(
                    term=msg.term,
                    stream=msg.stream,
                    seq=msg.seq,
                    tokens=toks,
                    sent_at=msg.sent_at,
                    busy_ms=msg.busy_ms,
                    logprobs=lps,
                )
        except ProtocolError as e:
            log.warning("bad frame on the return path: %s", e)
            return
        if isinstance(msg, Ids | Passed | BatchIds) and msg.term != self.term:
            log.info("dropped a %s frame of term %d (this pipeline's is %d)", msg.TYPE, msg.term, self.term)
            return
        if from_ring and isinstance(msg, Error) and msg.stream is None:  # the ring names every error's stream
            log.warning("ignored an error frame that names no stream: %s", msg.message[:200])
            return
        if isinstance(msg, Passed):
            _resolve(self._passed.pop((msg.stream, msg.seq), None))
        elif isinstance(msg, BatchIds):
            bfut = self._batches.get(msg.seq)
            if bfut is not None and not bfut.done():
                bfut.set_result(msg)
        elif isinstance(msg, Ids):
            fut = self._pending.get((msg.stream, msg.seq))
            if fut is not None:  # a step sent with send_step (maybe ahead of a ring run)
                if not fut.done():
                    self.busy_s[msg.stream] = msg.busy_ms / 1000.0
                    fut.set_result(Chosen(msg.tokens, msg.logprobs))
                return
            q = self._queues.get(msg.stream)
            if q is not None:
                self.busy_s[msg.stream] = msg.busy_ms / 1000.0
                q.put_nowait(Chosen(msg.tokens, msg.logprobs))
        elif isinstance(msg, Error) and msg.code == "paused" and msg.stage is not None:
            # its laptop's user (or heat, or the battery) needs it: every stream moves elsewhere
            node = self.placements[msg.stage].node if 0 <= msg.stage < len(self.placements) else "?"
            self.paused.add(node)
            self.mark_lost(node, f"the agent at {node} paused: {msg.message}")
        elif isinstance(msg, Error):
            ours = msg.stream is None or msg.stream in self._queues or any(k[0] == msg.stream for k in self._pending)
            log.log(
                logging.WARNING if ours else logging.DEBUG,  # a stream this coordinator does not run: not its concern
                "stage %s reported %s: %s (stream %s)",
                msg.stage,
                msg.code,
                msg.message,
                msg.stream,
            )
            for stream, q in self._queues.items():
                if msg.stream is None or stream == msg.stream:
                    q.put_nowait(PipelineError(f"stage {msg.stage}: {msg.message}", msg.code))
            if msg.stream is not None and self.on_stream_error is not None:
                self.on_stream_error(msg.stream, msg.seq, PipelineError(f"stage {msg.stage}: {msg.message}", msg.code))
            for (stream, seq), fut in list(self._pending.items()):
                ours = (msg.stream is None or stream == msg.stream) and (msg.seq is None or seq == msg.seq)
                if ours and not fut.done():
                    fut.set_exception(PipelineError(f"stage {msg.stage}: {msg.message}", msg.code))

    async def async_close(self) -> None:
        self._closing = True
        futs: list[asyncio.Future[Any]] = [*self._pending.values(), *self._batches.values()]
        for fut in futs:
            if not fut.done():
                fut.set_exception(PipelineError("the pipeline is shutting down", "shutdown"))
        for q in self._queues.values():
            q.put_nowait(PipelineError("the pipeline is shutting down", "shutdown"))
        if self._link is not None:
            await self._link.async_close()
        for t in self._watchers:
            t.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for ws in self._control:
            with contextlib.suppress(Exception):
                await ws.close()
        if self._session is not None:
            await self._session.close()


def _resolve(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)
