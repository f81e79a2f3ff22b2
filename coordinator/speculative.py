"""Speculative decoding over the pipeline, with mask-based KV rollback.

One round: the drafter proposes K tokens; the pending token and the K drafts go through the
ring as one ``fwd`` of K+1 positions, and the last stage returns the target's token for every
position (ids only). The longest prefix of drafts the target agrees with is accepted, plus
the target's own next token. The K-a rejected slots are rolled back by the ``rollback`` field
of the stream's *next* ``fwd``: each stage switches them off in its attention mask and steps
the logical position back. No extra round trip, no KV read or write.

Each target token is a function of its logits, the request's seed and its position alone
(see :mod:`agent.runtime.sampling`), so a speculative run gives exactly the plain run's tokens,
greedy or sampled.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from agent.protocol import SamplingSpec
from coordinator.drafting import Drafter, DraftSession
from coordinator.kpolicy import K_MAX, SpecStats
from coordinator.pipeline import Pipeline


@dataclass
class SpecConfig:
    drafter: Drafter
    k: int | None = None  # fixed K; None = chosen per round by the K policy
    k_max: int = K_MAX


@dataclass
class DraftHandle:
    session: DraftSession
    ready: Future[None] | None  # the draft's prefill of the prompt, if it has one


@dataclass
class SpecCounters:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def accept(drafts: Sequence[int], target: Sequence[int]) -> int:
    """How many drafts the target agrees with: the longest prefix with drafts[i] == target[i]."""
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return a


class Speculator:
    """Per-scheduler speculative decoding: one draft thread, shared cost estimates."""

    def __init__(self, pipeline: Pipeline, cfg: SpecConfig) -> None:
        self.pipeline = pipeline
        self.cfg = cfg
        self.stats = SpecStats(k_max=cfg.k_max)
        self.counters = SpecCounters()
        # drafting runs inference: never on the event loop; one thread serialises the draft model
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="draft")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[[], list[int] | None]) -> list[int] | None:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _next_k(self, remaining: int, k_override: int | None) -> int:
        k = k_override if k_override is not None else self.cfg.k
        if k is not None:
            return max(0, min(k, remaining - 1))
        return self.stats.next_k(remaining)

    def open_session(self, prompt: Sequence[int]) -> DraftHandle:
        """A draft session for a new stream; its prefill starts now, beside the target's."""
        session = self.cfg.drafter.session()
        prefill = getattr(session, "prefill", None)
        ready = self._pool.submit(prefill, list(prompt)) if prefill is not None else None
        return DraftHandle(session, ready)

    async def async_decode(
        self,
        stream: str,
        handle: DraftHandle,
        prompt: Sequence[int],
        first: int,
        *,
        max_tokens: int,
        sampling: SamplingSpec,
        k_override: int | None = None,
    ) -> AsyncGenerator[int, None]:
        """Tokens after the prefill (whose token is ``first``), ``first`` included."""
        session = handle.session
        if handle.ready is not None:  # the draft's prefill: not a cost of any round
            await asyncio.wrap_future(handle.ready)
        ctx = list(prompt)
        pending = first
        rollback = 0
        emitted = 0
        try:
            while True:
                ctx.append(pending)
                yield pending
                emitted += 1
                if emitted >= max_tokens:
                    return
                k = self._next_k(max_tokens - emitted, k_override)
                drafts: list[int] = []
                if k > 0:
                    t0 = time.perf_counter()
                    got = await self._run(functools.partial(session.propose, ctx, k))
                    drafts = list(got or [])[:k]
                    self.stats.observe_draft(time.perf_counter() - t0, k)
                n = len(drafts)
                t0 = time.perf_counter()
                toks = await self.pipeline.async_step(
                    stream,
                    [pending, *drafts],
                    rollback=rollback,
                    logits=range(n + 1) if n else (),
                    sampling=sampling,
                )
                self.stats.observe_step(n + 1, time.perf_counter() - t0)
                if len(toks) != n + 1:
                    raise RuntimeError(f"the last stage returned {len(toks)} tokens for {n + 1} positions")
                a = accept(drafts, toks)
                if n:
                    self.stats.observe_accept(n, a)
                    c = self.counters
                    c.rounds, c.proposed, c.accepted = c.rounds + 1, c.proposed + n, c.accepted + a
                rollback = n - a
                for t in toks[:a]:  # accepted drafts: the target's own tokens
                    ctx.append(t)
                    yield t
                    emitted += 1
                    if emitted >= max_tokens:
                        return
                pending = toks[a]  # the target's correction (or bonus token)
        finally:
            session.close()
