"""A request that asks for log-probabilities gets one per token it is given, the token's own,
whichever way it is decoded: step by step, round the ring, or speculatively (an accepted draft's
from the verify's position that confirmed it, a correction's from its own), one stream at a time
or in micro-batches. Played on fake rings whose "model" follows each token by a fixed one, with a
figure per (token, next)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from agent.protocol import BatchIds, Part, SamplingSpec, TokenLogprobs
from coordinator.batching.batcher import Batcher
from coordinator.batching.scheduler import GenRequest, Scheduler
from coordinator.ring.pipeline import Chosen, PipelineError, RingCapacity
from coordinator.speculative.decoding import SpecConfig, SpecCounters


def nxt(t: int) -> int:
    return (t * 7 + 3) % 50


def figure(prev: int, tok: int) -> TokenLogprobs:
    v = -(prev % 10) - tok / 100
    return TokenLogprobs(v, ((tok, v), ((tok + 1) % 50, -20.0)))


class FakeRing:
    """A pipeline's interface over the toy model: every stream's context, rollbacks and all."""

    def __init__(self, stages: int = 2) -> None:
        self.placements = [object()] * stages
        self.home_first = False
        self.busy_s: dict[str, float] = {}
        self.ctx: dict[str, list[int]] = {}
        self.asked: list[SamplingSpec] = []
        self._n = 0

    def new_stream(self) -> str:
        self._n += 1
        return f"s{self._n}"

    def _step(
        self, stream: str, ids: Sequence[int], start: bool, rollback: int, logits: Sequence[int], s: SamplingSpec
    ) -> Chosen:
        self.asked.append(s)
        ctx = self.ctx.setdefault(stream, [])
        if start:
            ctx.clear()
        if rollback:
            del ctx[-rollback:]
        ctx.extend(ids)
        base = len(ctx) - len(ids)
        prevs = [ctx[base + r] for r in (list(logits) or [len(ids) - 1])]
        toks = [nxt(p) for p in prevs]
        lps = tuple(figure(p, t) for p, t in zip(prevs, toks, strict=True)) if s.logprobs is not None else None
        return Chosen(toks, lps)

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
        fut: asyncio.Future[tuple[int, ...]] = asyncio.get_running_loop().create_future()
        fut.set_result(self._step(stream, ids, start, rollback, logits, sampling or SamplingSpec()))
        if passed is not None and not passed.done():
            passed.set_result(None)
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
        s = sampling or SamplingSpec()
        q: asyncio.Queue[tuple[int, ...] | PipelineError] = asyncio.Queue()
        got = self._step(stream, ids, start, rollback, (), s)
        q.put_nowait(got)
        for _ in range(auto):
            if got[-1] in stop:
                break
            got = self._step(stream, [got[-1]], False, 0, (), s)
            q.put_nowait(got)
        return q

    def end_run(self, stream: str) -> None:
        pass

    async def async_close_stream(self, stream: str) -> None:
        self.ctx.pop(stream, None)


class HalfRight:
    """Drafts the model's next two tokens right, then a wrong one: every verify accepts two and
    corrects the third."""

    name = "half-right"

    def session(self) -> Any:
        return self

    confidence = None
    caught_up = 0
    last_proposal = None

    def propose(self, context: Sequence[int], k: int, min_conf: float = 0.0) -> list[int]:
        a = nxt(context[-1])
        b = nxt(a)
        return [a, b, (nxt(b) + 1) % 50][:k]

    def verified(self, proposal: object, proposed: int, accepted: int) -> None:
        pass

    def close(self) -> None:
        pass


def _expected(prompt: Sequence[int], n: int, stop: frozenset[int] = frozenset()) -> list[tuple[int, TokenLogprobs]]:
    out, prev = [], prompt[-1]
    for _ in range(n):
        tok = nxt(prev)
        if tok in stop:
            break
        out.append((tok, figure(prev, tok)))
        prev = tok
    return out


def _generate(sched: Scheduler, req: GenRequest) -> list[int]:
    async def go() -> list[int]:
        return [t async for t in sched.async_generate(req)]

    return asyncio.run(go())


WAYS = {
    "stepped": {"ring_loop": False},
    "in the ring": {"ring_loop": True},
    "speculated": {"spec": SpecConfig(HalfRight(), k=3)},
}


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("stop", [frozenset(), frozenset({14})], ids=["to the length", "to a stop id"])
def test_every_token_gets_its_own_logprobs(way: str, stop: frozenset[int]) -> None:
    ring = FakeRing()
    sched = Scheduler(ring, **WAYS[way])  # type: ignore[arg-type]
    prompt = (3, 7, 1)
    spec = SpecCounters()
    req = GenRequest(
        prompt, max_tokens=11, sampling=SamplingSpec(logprobs=1), stop_ids=stop, logprobs=[], spec_counters=spec
    )
    toks = _generate(sched, req)
    want = _expected(prompt, 11, stop)
    assert toks == [t for t, _ in want] and len(toks) == (11 if not stop else 2)
    assert req.logprobs == [lp for _, lp in want]
    if way == "speculated" and not stop:  # drafts accepted and drafts corrected, both
        assert 0 < spec.accepted < spec.proposed
    assert all(s.logprobs == 1 for s in ring.asked)  # every step asked the last stage for them


@pytest.mark.parametrize("way", WAYS)
def test_a_request_that_does_not_ask_asks_nothing_of_the_ring(way: str) -> None:
    ring = FakeRing()
    req = GenRequest((3, 7, 1), max_tokens=6)
    toks = _generate(Scheduler(ring, **WAYS[way]), req)  # type: ignore[arg-type]
    assert toks == [t for t, _ in _expected((3, 7, 1), 6)] and req.logprobs is None
    assert all(s.logprobs is None for s in ring.asked)


def test_a_token_without_the_logprobs_asked_fails_the_request_clearly() -> None:
    ring = FakeRing()
    req = GenRequest((3, 7, 1), max_tokens=4, logprobs=[])  # the sink, but the stages were not asked
    with pytest.raises(PipelineError) as e:
        _generate(Scheduler(ring, ring_loop=False), req)  # type: ignore[arg-type]
    assert e.value.code == "no_logprobs"


class FakeBatchRing(FakeRing):
    """A paged ring's interface over the toy model: micro-batches answered by one BatchIds."""

    on_stream_error: Any = None

    def capacity(self) -> RingCapacity:
        return RingCapacity(total_blocks=4096, block_size=16, token_budget=512)

    def close_stream_nowait(self, stream: str) -> None:
        self.ctx.pop(stream, None)

    def send_batch(self, parts: Sequence[Part], ids: Sequence[int]) -> asyncio.Future[BatchIds]:
        streams: list[str] = []
        counts: list[int] = []
        toks: list[int] = []
        lps: list[tuple[TokenLogprobs, ...] | None] = []
        at = 0
        for p in parts:
            rows, at = list(ids[at : at + p.n]), at + p.n
            if not p.logits:
                self._step(p.stream, rows, p.start, p.rollback, [], p.sampling)  # (its token is not wanted)
                continue
            got = self._step(p.stream, rows, p.start, p.rollback, range(p.n - p.logits, p.n), p.sampling)
            streams.append(p.stream)
            counts.append(len(got))
            toks += got
            lps.append(got.logprobs)
        answer = BatchIds(
            term=1,
            seq=0,
            streams=tuple(streams),
            counts=tuple(counts),
            tokens=tuple(toks),
            logprobs=None if all(x is None for x in lps) else tuple(lps),
        )
        fut: asyncio.Future[BatchIds] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(fut.set_result, answer)
        return fut


@pytest.mark.parametrize("spec", [None, SpecConfig(HalfRight(), k=3)], ids=["plain", "speculated"])
def test_every_token_of_a_micro_batched_stream_gets_its_own_logprobs(spec: SpecConfig | None) -> None:
    ring = FakeBatchRing()
    batcher = Batcher(ring, spec=spec, prefix_cache=False)  # type: ignore[arg-type]
    prompts = [(3, 7, 1), (2, 2), (5,) * 40]
    counted = SpecCounters()
    reqs = [
        GenRequest(prompts[0], max_tokens=11, sampling=SamplingSpec(logprobs=2), logprobs=[], spec_counters=counted),
        GenRequest(prompts[1], max_tokens=7),  # beside them, one that does not ask
        GenRequest(prompts[2], max_tokens=9, sampling=SamplingSpec(logprobs=0), logprobs=[], stop_ids=frozenset({3})),
    ]

    async def go() -> list[list[int]]:
        async def one(r: GenRequest) -> list[int]:
            return [t async for t in batcher.async_generate(r)]

        try:
            return list(await asyncio.gather(*(one(r) for r in reqs)))
        finally:
            batcher.shutdown()

    got = asyncio.run(go())
    for p, r, toks in zip(prompts, reqs, got, strict=True):
        want = _expected(p, r.max_tokens, r.stop_ids)
        assert toks == [t for t, _ in want]
        assert r.logprobs == (None if r.logprobs is None else [lp for _, lp in want])
    if spec is not None:  # drafts accepted and drafts corrected, both
        assert 0 < counted.accepted < counted.proposed
