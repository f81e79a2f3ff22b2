"""Micro-batching scheduler: up to S streams in flight through the pipeline at once.

Each admitted request is a coroutine that sends one step and awaits its token; while it
waits, the other streams' steps occupy the other stages. Streams join and leave at any step,
each with its own prompt, length and sampling settings. Requests beyond S wait for a slot.
With a drafter configured, every stream decodes speculatively (see
:mod:`coordinator.speculative.decoding`); speculative streams interleave like plain ones.

A request whose sampling asks for log-probabilities (``SamplingSpec.logprobs``) gets them, as
the last stage computed them, in its ``logprobs`` list: one per token, appended before the token
is yielded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field, replace

from agent.protocol import SamplingSpec, TokenLogprobs
from coordinator.ring.pipeline import Pipeline, PipelineError, last_logprobs, run_step
from coordinator.speculative.decoding import DraftHandle, SpecConfig, SpecCounters, Speculator

log = logging.getLogger(__name__)
PREFILL_CHUNK = 1024  # the most prompt tokens one frame carries
PREFILL_MIN_CHUNK = 128  # more pieces than stages only this long (64: 1.02x against 1.20x at 128)
PREFILL_MIN_PIECE = 16  # a short prompt: one piece a stage, down to this (48 tokens: 1.12x)
PREFILL_PIECES_PER_STAGE = 2
MAX_STOP = 64  # stop ids the ring itself checks (the coordinator checks them all)
MAX_RECOVERIES = 3  # re-plans one request rides through before it gives up
# errors of a pipeline that lost a node, or of steps that reached a re-planned one
RECOVERABLE = frozenset({"node_lost", "stale_term", "unknown_stream", "not_assigned"})


@dataclass(frozen=True)
class GenRequest:
    prompt: tuple[int, ...]
    max_tokens: int = 256
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    stop_ids: frozenset[int] = frozenset()
    ids_only: bool = True  # False: the last stage returns logits (the naive design)
    spec_k: int | None = None  # fixed draft length for this request (0: no speculation)
    spec_depth: int | None = None  # verify frames in flight (2: draft ahead); None: the speculator's choice
    spec_min_conf: float | None = None  # stop drafting below this confidence (0: never); None: from costs
    # this request's speculation figures, filled in as it runs (None: not wanted)
    spec_counters: SpecCounters | None = field(default=None, compare=False)
    # each yielded token's log-probabilities, appended before it is yielded (None: not wanted; the
    # sampling's ``logprobs`` says how many alternatives each lists)
    logprobs: list[TokenLogprobs] | None = field(default=None, compare=False)

    def note_logprobs(self, lp: TokenLogprobs | None) -> None:
        """Keep the next token's log-probabilities, where they are wanted (and must have come)."""
        if self.logprobs is None:
            return
        if lp is None:
            raise PipelineError("the last stage sent no log-probabilities for a token", "no_logprobs")
        self.logprobs.append(lp)


Step = tuple[int, TokenLogprobs | None]  # a generated token and its log-probabilities (None: not asked)


def prefill_chunks(
    n: int,
    stages: int,
    max_chunk: int = PREFILL_CHUNK,
    min_chunk: int = PREFILL_MIN_CHUNK,
    per_stage: int = PREFILL_PIECES_PER_STAGE,
    min_piece: int = PREFILL_MIN_PIECE,
) -> list[int]:
    """How many prompt tokens each prefill frame carries, in order (they sum to ``n``).

    All frames are sent at once, so on several stages the prompt's pieces flow through the
    ring like micro-batches: stage 1 runs the first piece while stage 0 runs the second, and
    the first token comes about when the slowest stage has seen the whole prompt, not after
    every stage in turn. So cut a prompt into ``per_stage`` pieces a stage (0: no cutting),
    none under ``min_chunk`` tokens (a small piece runs slower per token; the last stage also turns
    each piece's last position into a token) nor over ``max_chunk``. A prompt too short for
    a piece a stage of ``min_chunk`` still gets one a stage, of ``min_piece`` tokens at least
    (measured on 2 stages: 48 tokens in 2 pieces 1.12x faster than one frame, 200 in 2
    pieces 1.17x, but 200 in 4 pieces 0.94x). One stage: only the cap.
    """
    if n <= 0:
        return []
    pieces = -(-n // max_chunk)
    if stages > 1 and per_stage > 0:
        many = min(per_stage * stages, n // min_chunk)
        pieces = max(pieces, many if many >= stages else min(stages, n // min_piece))
    base, extra = divmod(n, pieces)
    return [base + (1 if i < extra else 0) for i in range(pieces)]


async def _settle(futs: list[asyncio.Future[tuple[int, ...]]]) -> tuple[int, ...]:
    """Wait for every prefill frame; the last one's tokens, or the first error raised."""
    res = await asyncio.gather(*futs, return_exceptions=True)
    for r in res:
        if isinstance(r, BaseException):
            raise r
    last = res[-1] if res else ()
    assert isinstance(last, tuple)
    return last


def _read_outcome(fut: asyncio.Future[tuple[int, ...]]) -> None:
    if not fut.cancelled():
        fut.exception()


def _ring_stop(req: GenRequest) -> list[int]:
    """The stop ids a ring run checks itself (the coordinator checks them all)."""
    return sorted(req.stop_ids)[:MAX_STOP]


class Scheduler:
    def __init__(
        self, pipeline: Pipeline, max_streams: int = 4, spec: SpecConfig | None = None, ring_loop: bool = True
    ) -> None:
        if max_streams < 1:
            raise ValueError("max_streams must be at least 1")
        self.pipeline = pipeline
        self.ring_loop = ring_loop  # plain decoding: the last stage feeds stage 0 itself
        self.speculator = Speculator(pipeline, spec) if spec is not None else None
        self.max_streams = max_streams
        self._slots = asyncio.Semaphore(max_streams)
        self.active = 0
        self.waiting = 0
        self.tokens_out = 0
        self.replays = 0  # generations resumed on a re-planned pipeline
        self.prefill_per_stage = PREFILL_PIECES_PER_STAGE  # prompt pieces a stage (0: whole frames)
        # set by the coordinator: re-plan after ``failed`` lost a node (raises if it cannot)
        self.recover: Callable[[Pipeline], Awaitable[None]] | None = None

    def set_pipeline(self, pipeline: Pipeline) -> None:
        """A new pipeline after a re-plan: new steps go there."""
        self.pipeline = pipeline
        if self.speculator is not None:
            self.speculator.pipeline = pipeline

    async def async_generate(self, req: GenRequest) -> AsyncGenerator[int, None]:
        """Yield the generated token ids (stop token excluded) as they arrive.

        If the pipeline loses a node mid-generation and a ``recover`` callback is set, the
        request waits for the re-planned pipeline, replays its prompt plus every token it has
        already yielded as the new prompt, and carries on: the caller sees a pause, and no
        token is lost or repeated (greedy and seeded sampling are functions of the position).
        """
        if not req.prompt:
            raise ValueError("empty prompt")
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.active += 1
        emitted: list[int] = []
        try:
            for attempt in range(MAX_RECOVERIES + 1):
                pipeline = self.pipeline
                sub = replace(req, prompt=req.prompt + tuple(emitted), max_tokens=req.max_tokens - len(emitted))
                if sub.max_tokens <= 0:
                    return
                try:
                    async for tok, lp in self._generate_once(pipeline, sub):
                        req.note_logprobs(lp)
                        emitted.append(tok)
                        self.tokens_out += 1
                        yield tok
                    return
                except PipelineError as e:
                    # any error of a pipeline already replaced (a re-plan) is a reason to move on
                    moved = self.pipeline is not pipeline
                    if self.recover is None or not (moved or e.code in RECOVERABLE) or attempt == MAX_RECOVERIES:
                        raise
                    log.warning("generation paused after %d tokens (%s); recovering", len(emitted), e)
                    await self.recover(pipeline)
                    self.replays += 1
        finally:
            self.active -= 1
            self._slots.release()

    async def _generate_once(self, pipeline: Pipeline, req: GenRequest) -> AsyncGenerator[Step, None]:
        """One attempt at ``req`` on ``pipeline``: in the ring, speculatively, or step by step."""
        stream = pipeline.new_stream()
        spec = self.speculator if req.ids_only and req.spec_k != 0 else None
        draft = (
            spec.open_session(req.prompt, req.spec_k, req.max_tokens, defer=pipeline.home_first)
            if spec is not None
            else None
        )
        try:
            if spec is not None and draft is not None:
                gen = self._speculated(pipeline, stream, req, spec, draft)
            elif req.ids_only and self.ring_loop:  # plain throughout (also a request the draft's
                gen = self._in_ring(pipeline, stream, req)  # prefill would not pay for)
            else:
                gen = self._stepped(pipeline, stream, req)
            async with contextlib.aclosing(gen):
                async for step in gen:
                    yield step
        finally:
            if draft is not None:
                draft.session.close()
            try:
                await pipeline.async_close_stream(stream)
            except Exception as e:  # the request is over either way
                log.info("closing stream %s: %s", stream, e)

    async def _speculated(
        self, pipeline: Pipeline, stream: str, req: GenRequest, spec: Speculator, draft: DraftHandle
    ) -> AsyncGenerator[Step, None]:
        """Speculative decoding: the target's prefill, then drafted tokens verified by the ring."""
        t0 = time.perf_counter()
        passed: asyncio.Future[None] | None = None
        if draft.deferred is not None:
            # the draft shares stage 0's cores: it prefills once stage 0 has the whole prompt
            passed = asyncio.get_running_loop().create_future()
            passed.add_done_callback(lambda _: spec.start_prefill(draft))
        toks = await self._prefill(pipeline, stream, req, passed)
        self._observe_prefill(req, time.perf_counter() - t0, draft)
        # the prefill's result also resolves ``passed``, but its callback may not have run
        # yet: make sure the deferred prefill is under way (a no-op once it is)
        spec.start_prefill(draft)
        gen = spec.async_decode(
            stream,
            draft,
            req.prompt,
            toks[-1],
            first_logprobs=last_logprobs(toks),
            max_tokens=req.max_tokens,
            sampling=req.sampling,
            stop=_ring_stop(req),
            k_override=req.spec_k,
            depth_override=req.spec_depth,
            conf_override=req.spec_min_conf,
            counters=req.spec_counters,
        )
        try:
            async for tok, lp in gen:
                if tok in req.stop_ids:
                    return
                yield tok, lp
        finally:
            await gen.aclose()

    async def _stepped(self, pipeline: Pipeline, stream: str, req: GenRequest) -> AsyncGenerator[Step, None]:
        """Plain decoding through the coordinator: one step a token (or logits, the naive design)."""
        t0 = time.perf_counter()
        toks = await self._prefill(pipeline, stream, req)
        self._observe_prefill(req, time.perf_counter() - t0, None)
        for i in range(req.max_tokens):
            tok = toks[-1]
            if tok in req.stop_ids:
                return
            yield tok, last_logprobs(toks)
            if i + 1 == req.max_tokens:
                return
            toks = await pipeline.send_step(stream, [tok], sampling=req.sampling, ret_logits=not req.ids_only)

    async def _in_ring(self, pipeline: Pipeline, stream: str, req: GenRequest) -> AsyncGenerator[Step, None]:
        """Plain decoding with the coordinator off the per-token path (``Fwd.auto``)."""
        t0 = time.perf_counter()
        chunks = self._pieces(pipeline, req.prompt)
        futs = [pipeline.send_step(stream, c, start=i == 0, sampling=req.sampling) for i, c in enumerate(chunks[:-1])]
        try:
            q = await pipeline.async_run(
                stream,
                chunks[-1],
                start=len(chunks) == 1,
                auto=req.max_tokens - 1,
                stop=_ring_stop(req),
                sampling=req.sampling,
            )
        except BaseException:
            for f in futs:  # the pieces sent before fail too: their errors are read here, not logged as lost
                f.add_done_callback(_read_outcome)
            raise
        await _settle(futs)  # a piece the ring refused fails the request here
        stats = self.speculator.stats if self.speculator is not None else None
        prev: float | None = None
        for _ in range(req.max_tokens):
            tok, lp = run_step(await q.get())
            now = time.perf_counter()
            if prev is None:  # the prompt's token
                self._observe_prefill(req, now - t0, None)
            elif stats is not None:  # the K policy's plain rate stays current
                stats.observe_ring(now - prev)
            prev = now
            if tok in req.stop_ids:
                return
            yield tok, lp

    def _observe_prefill(self, req: GenRequest, seconds: float, draft: DraftHandle | None) -> None:
        """Tell the K policy how long the target's prefill took, and whether the draft's ran
        beside it (what that costs a request is the policy's to weigh)."""
        if self.speculator is not None:
            beside = draft is not None and draft.ready is not None
            self.speculator.stats.observe_target_prefill(len(req.prompt), seconds, beside)

    async def _prefill(
        self, pipeline: Pipeline, stream: str, req: GenRequest, passed: asyncio.Future[None] | None = None
    ) -> tuple[int, ...]:
        """Send the prompt's pieces all at once (see :func:`prefill_chunks`); the last one's tokens.
        ``passed``: resolved once stage 0 has computed the last piece."""
        chunks = self._pieces(pipeline, req.prompt)
        futs = [
            pipeline.send_step(
                stream,
                c,
                start=i == 0,
                sampling=req.sampling,
                ret_logits=not req.ids_only,
                passed=passed if i == len(chunks) - 1 else None,
            )
            for i, c in enumerate(chunks)
        ]
        return await _settle(futs)

    def _pieces(self, pipeline: Pipeline, prompt: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The prompt cut for ``pipeline`` (see :func:`prefill_chunks`)."""
        out, off = [], 0
        for k in prefill_chunks(len(prompt), len(pipeline.placements), per_stage=self.prefill_per_stage):
            out.append(prompt[off : off + k])
            off += k
        return out

    def shutdown(self) -> None:
        if self.speculator is not None:
            self.speculator.shutdown()
