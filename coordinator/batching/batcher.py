"""Continuous batching around a ring of paged stages: the I/O shell of :mod:`.microbatch`.

Every request is a stream of this scheduler. Whenever something changes (a request arrives, a
micro-batch's answer comes back, a part fails, a client goes away) the pump asks the pure policy
(:func:`~coordinator.batching.microbatch.next_batch`) for micro-batches until it has none, and
sends each as one :class:`~agent.protocol.batch.Batch` into stage 0: prompt chunks and decode
steps of many streams, computed by each stage in one infer call, about S micro-batches out on
S stages. The last stage answers with every part's tokens (:class:`~agent.protocol.batch.BatchIds`),
and their log-probabilities for the streams whose sampling asks (kept in the request's
``logprobs``, one per token, before the token is yielded).

The KV ledger is what the streams hold: the smallest pool's blocks less every stream's. A
stream's blocks return when its ``Close`` is sent, which every stage takes before any later
frame. A stream whose part fails (a stage refused it, a pool was short after all), or that the
policy preempts, is closed on every stage and becomes a prompt of its tokens so far: it is
recomputed, and greedy and seeded sampling (a function of the position) give the same tokens.
After a node is lost the same holds for every stream, on the re-planned pipeline.

The parts around this shell: a new request passes the admission gate (:mod:`.admission_gate`)
first; failed parts and a broken pipeline are :mod:`.recovery`'s; each stream's own state and
its next part are :mod:`.streams`'; with a draft configured, a stream's decode part is a verify
of its drafts (:mod:`.drafts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable

from agent.protocol import BatchIds, TokenLogprobs
from agent.protocol.batch import MAX_PARTS
from agent.runtime.blocks import blocks_for
from coordinator.batching.admission_gate import AdmissionGate
from coordinator.batching.drafts import BatchDrafter
from coordinator.batching.microbatch import Plan, RingState, SchedState, next_batch
from coordinator.batching.prefix import PrefixCache
from coordinator.batching.recovery import Recovery
from coordinator.batching.scheduler import GenRequest
from coordinator.batching.streams import Flight, Stream
from coordinator.ring.pipeline import Pipeline, PipelineError, RingCapacity
from coordinator.speculative.decoding import SpecConfig

log = logging.getLogger(__name__)
QUEUE_LIMIT = 64  # requests waiting for blocks or a stream slot before the API answers 503
MAX_PLANS = 64  # micro-batches planned in one go (the policy stops far sooner)


class Batcher:
    """Many streams' steps per stage step; the same ``async_generate`` as :class:`Scheduler`."""

    def __init__(
        self,
        pipeline: Pipeline,
        max_streams: int = MAX_PARTS,
        queue_limit: int = QUEUE_LIMIT,
        spec: SpecConfig | None = None,
        prefix_cache: bool = True,
    ) -> None:
        self.use_prefix = prefix_cache
        self.prefix: PrefixCache | None = None
        self.pipeline = pipeline
        self.max_streams = max(1, min(max_streams, MAX_PARTS))
        self.queue_limit = queue_limit
        self.drafter = BatchDrafter(spec) if spec is not None else None
        self.speculator = None  # the per-stream path's (its K policy does not apply to batches)
        self.tokens_out = 0
        self.replays = 0  # streams recomputed after a failover, a failed part or a preemption
        self.batches_sent = 0
        self.parts_sent = 0
        self._streams: dict[str, Stream] = {}
        self._flights: dict[int, Flight] = {}
        self._arrivals = itertools.count()
        self._ticks = itertools.count(1)
        self._seqs = itertools.count(1)
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._cap: RingCapacity | None = None
        self._gate = AdmissionGate()
        self._recovery = Recovery(
            self._streams, lambda: self.pipeline, lambda s: self._restart(s, close=True), self._fail, self._poke
        )
        self._attach(pipeline)

    @property
    def recover(self) -> Callable[[Pipeline], Awaitable[None]] | None:
        """How a broken pipeline is re-planned (the coordinator's failover; None: it is not)."""
        return self._recovery.recover

    @recover.setter
    def recover(self, recover: Callable[[Pipeline], Awaitable[None]] | None) -> None:
        self._recovery.recover = recover

    # -- what the API and the status pages read ---------------------------------------------------
    @property
    def active(self) -> int:
        return sum(s.started for s in self._streams.values())

    @property
    def waiting(self) -> int:
        return sum(not s.started for s in self._streams.values())

    def summary(self) -> dict[str, float | int]:
        """What ``lakeshard status --json`` shows of the batching."""
        return {
            "streams": self.active,
            "waiting": self.waiting,
            "micro_batches": self.batches_sent,
            "parts_per_batch": round(self.parts_sent / self.batches_sent, 2) if self.batches_sent else 0.0,
            "recomputed": self.replays,
            "tokens": self.tokens_out,
            "prefix_hit_rate": round(self.prefix.hit_rate, 4) if self.prefix is not None else 0.0,
            "prefix_entries": len(self.prefix.entries) if self.prefix is not None else 0,
        }

    def set_pipeline(self, pipeline: Pipeline) -> None:
        """A re-planned pipeline: every stream starts over on it from its tokens so far."""
        if pipeline is self.pipeline:
            return
        self._attach(pipeline)
        for f in self._flights.values():
            f.fut.cancel()
        self._flights.clear()
        for s in self._streams.values():
            self._restart(s, close=False)
        self._poke()

    def _attach(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        pipeline.on_stream_error = self._on_error
        self._cap = cap = pipeline.capacity()
        # the old stages' entries went with their assignment; half of the pool may hold heads
        self.prefix = PrefixCache(cap.block_size, cap.total_blocks // 2) if self.use_prefix and cap else None

    # -- requests -----------------------------------------------------------------------------------
    async def async_generate(self, req: GenRequest) -> AsyncGenerator[int, None]:
        """Yield the generated token ids (stop token excluded) as they arrive. A request the
        cluster cannot take now raises a PipelineError with ``retry_after`` (the API's 503)."""
        if not req.prompt:
            raise ValueError("empty prompt")
        if req.max_tokens <= 0:
            return
        refused = self.refusal(len(req.prompt))
        if refused is not None:
            raise refused
        s = Stream(self.pipeline.new_stream(), req, next(self._arrivals), list(req.prompt))
        s.ready_since = next(self._ticks)
        s.drafts = self.drafter.open(req) if self.drafter is not None else None
        if self.prefix is not None:
            s.fork_from(self.prefix)
        self._streams[s.name] = s
        self._ensure_pump()
        self._poke()
        try:
            while True:
                item = await s.out.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._finish(s)

    def refusal(self, prompt: int) -> PipelineError | None:
        """Why a request of ``prompt`` tokens cannot be taken now (None: it can): the admission
        queue is full (``overloaded``, with ``retry_after``), or no pool could ever hold it."""
        cap = self._capacity()
        return self._gate.refusal(
            prompt,
            cap,
            waiting=self.waiting,
            started=self.active,
            free_blocks=self._free(cap),
            max_streams=self.max_streams,
            limit=self.queue_limit,
        )

    def _capacity(self) -> RingCapacity:
        cap = self._cap or self.pipeline.capacity()
        if cap is None:
            raise PipelineError("the pipeline's stages are not paged: they cannot batch", "not_paged")
        self._cap = cap
        return cap

    def _free(self, cap: RingCapacity) -> int:
        held = sum(s.blocks - s.shared for s in self._streams.values())
        return max(0, cap.total_blocks - held - (self.prefix.held_blocks if self.prefix is not None else 0))

    def _finish(self, s: Stream, keep: bool = False) -> None:
        """The request is over (answered, failed, or its client left): its blocks go back, or,
        when it was answered (``keep``), its whole blocks may stay as a cached prompt head."""
        if s.done:
            return
        s.done = True
        if s.drafts is not None and self.drafter is not None:
            self.drafter.close(s.drafts)
        self._streams.pop(s.name, None)
        self._gate.finished()
        self._leave_flight(s)
        if s.started:
            closes = [s.name]
            if keep and self.prefix is not None and s.in_flight is None and not s.fork_pending:
                closes = s.keep_in(self.prefix)
            for name in closes:
                self.pipeline.close_stream_nowait(name)
        s.unfork(self.prefix)
        self._poke()

    def _leave_flight(self, s: Stream) -> None:
        """``s`` no longer waits for its micro-batch's answer; a micro-batch that no stream waits
        for any more is forgotten (if its answer still comes, it is dropped)."""
        if s.in_flight is not None:
            f = self._flights.get(s.in_flight)
            if f is not None:
                f.streams.pop(s.name, None)
                if not f.streams:
                    self._flights.pop(s.in_flight, None)

    def _fail(self, s: Stream, err: PipelineError) -> None:
        """The request fails with ``err`` (its client sees it)."""
        s.out.put_nowait(err)
        self._finish(s)

    # -- the pump -----------------------------------------------------------------------------------
    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run(), name="batcher")

    def _poke(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._recovery.busy:
                continue
            try:
                self._plan_all()
            except PipelineError as e:
                self._recovery.lost(e)
            except Exception as e:  # a bug here must not wedge every request: fail them, say why
                log.exception("micro-batch scheduler failed")
                for s in list(self._streams.values()):
                    s.out.put_nowait(PipelineError(f"the scheduler failed: {e}", "internal"))

    def _plan_all(self) -> None:
        cap = self._capacity()
        for _ in range(MAX_PLANS):
            if not self._streams:
                return
            ring = RingState(
                stages=len(self.pipeline.placements),
                token_budget=cap.token_budget,
                free_blocks=self._free(cap),
                total_blocks=cap.total_blocks,
                block_size=cap.block_size,
                in_flight=len(self._flights),
                max_streams=self.max_streams,
            )
            states = (s.state() for s in self._streams.values())
            plan = next_batch(SchedState(ring, tuple(st for st in states if st is not None)))
            if plan is not None:
                self._apply(plan)
            short = (plan is not None and plan.waiting) or self._short(cap)
            gone = self.prefix.evict_one() if short and self.prefix is not None else None
            if gone is not None:  # blocks are short: a cached head makes room
                self.pipeline.close_stream_nowait(gone)
            elif plan is None:
                return

    def _short(self, cap: RingCapacity) -> bool:
        """Whether the oldest request that has not started waits for blocks."""
        new = [s for s in self._streams.values() if not s.started]
        if not new:
            return False
        oldest = min(new, key=lambda s: s.arrival)
        return blocks_for(len(oldest.tokens) + 1, cap.block_size) > self._free(cap)

    def _apply(self, plan: Plan) -> None:
        for name in plan.too_long:
            err = PipelineError("the answer no longer fits the cluster's KV cache", "context_length_exceeded")
            self._fail(self._streams[name], err)
        for name in plan.preempt:
            log.info("preempting stream %s: its blocks go to an older one", name)
            self._restart(self._streams[name], close=True)
        if not plan.parts:
            return
        parts, ids, riders = [], [], {}
        for pp in plan.parts:
            s = self._streams[pp.stream]
            part, rows = s.take(pp, next(self._seqs))
            ids += rows
            parts.append(part)
            riders[s.name] = s
        fut = self.pipeline.send_batch(parts, ids)
        for s in riders.values():
            s.in_flight = id(fut)
        self._flights[id(fut)] = Flight(riders, fut)
        self.batches_sent += 1
        self.parts_sent += len(parts)
        fut.add_done_callback(lambda f: self._landed(id(f), f))

    def _restart(self, s: Stream, *, close: bool) -> None:
        """Start ``s`` over from its tokens so far (its stages' state is gone or wrong)."""
        if close and s.started and not s.fork_pending:
            self.pipeline.close_stream_nowait(s.name)
        s.reset(self.prefix)
        s.ready_since = next(self._ticks)
        self.replays += 1

    # -- answers ------------------------------------------------------------------------------------
    def _landed(self, key: int, fut: asyncio.Future[BatchIds]) -> None:
        flight = self._flights.pop(key, None)
        if flight is None or fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self._poke()
            self._recovery.lost(exc if isinstance(exc, PipelineError) else PipelineError(str(exc)))
            return
        answer = fut.result()
        got, scored = answer.tokens_of(), answer.logprobs_of()
        tick = next(self._ticks)
        for s in flight.streams.values():
            part = s.part
            s.in_flight, s.part, s.ready_since = None, None, tick
            if part is None or not part.logits:
                continue
            toks = got.get(s.name)
            if toks is None or len(toks) != part.logits:  # its part failed on a stage (the error says why)
                self._recovery.part_failed(s, PipelineError("a stage dropped its part", "part_failed"))
                continue
            new = self._confirmed(s, toks)
            lps = scored.get(s.name)
            self._deliver(s, toks[new], lps[new] if lps is not None else None)
            if not s.done and s.drafts is not None and self.drafter is not None:
                self.drafter.start(s.drafts, s.tokens, s.req.max_tokens - s.emitted, self._poke)
        self._poke()

    def _confirmed(self, s: Stream, toks: tuple[int, ...]) -> slice:
        """Which of a part's tokens are new: the drafts the target agrees with and its own next
        one (the rejected drafts' positions become the next part's rollback); without drafts,
        its last."""
        sent, s.sent_drafts = s.sent_drafts, []
        if not sent:
            return slice(-1, None)
        assert s.drafts is not None and self.drafter is not None
        a = self.drafter.verdict(s.drafts, sent, toks)
        s.rollback = len(sent) - a
        return slice(0, a + 1)

    def _deliver(self, s: Stream, toks: tuple[int, ...], lps: tuple[TokenLogprobs, ...] | None) -> None:
        """A stream's new tokens (with their log-probabilities, where they came) to its request."""
        for i, tok in enumerate(toks):
            if tok in s.req.stop_ids:
                s.out.put_nowait(None)
                self._finish(s, keep=True)
                return
            try:
                s.req.note_logprobs(lps[i] if lps is not None else None)
            except PipelineError as e:
                self._fail(s, e)
                return
            s.tokens.append(tok)
            s.emitted += 1
            self.tokens_out += 1
            s.out.put_nowait(tok)
            if s.emitted >= s.req.max_tokens:
                s.out.put_nowait(None)
                self._finish(s, keep=True)
                return

    def _on_error(self, stream: str, seq: int | None, err: PipelineError) -> None:
        """A stage refused one of a stream's parts."""
        s = self._streams.get(stream)
        if s is None or (seq is not None and seq < s.first_seq):
            return  # a stream that ended, or a part from before its last start
        self._leave_flight(s)
        self._recovery.part_failed(s, err)
        self._poke()

    def shutdown(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        self._recovery.shutdown()
        if self.drafter is not None:
            self.drafter.shutdown()
        for s in list(self._streams.values()):
            s.out.put_nowait(PipelineError("the coordinator is shutting down", "shutdown"))
        with contextlib.suppress(RuntimeError):
            self._poke()
