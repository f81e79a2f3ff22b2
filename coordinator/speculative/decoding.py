"""Speculative decoding over the pipeline, with mask-based KV rollback.

One round: the drafter proposes K tokens; the pending token and the K drafts go through the
ring as one ``fwd`` of K+1 positions, and the last stage returns the target's token for every
position (ids only). The longest prefix of drafts the target agrees with is accepted, plus
the target's own next token. The K-a rejected slots are rolled back by the ``rollback`` field
of the stream's *next* ``fwd``: each stage switches them off in its attention mask and steps
the logical position back. No extra round trip, no KV read or write.

Each target token is a function of its logits, the request's seed and its position alone
(see :mod:`agent.runtime.sampling`), so a speculative run gives exactly the plain run's tokens,
greedy or sampled. Where the sampling asks for log-probabilities, a verify's last stage computes
them at every position it turns into a token, so each token, an accepted draft or the target's
own, comes with those of the logits that chose it.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from agent.protocol import SamplingSpec, TokenLogprobs
from coordinator.ring.pipeline import Pipeline, logprobs_of, run_step
from coordinator.speculative.drafting import Drafter, DraftSession
from coordinator.speculative.kpolicy import K_MAX, SpecCosts, SpecStats, match_bar, match_round_pays

RUN_MIN, RUN_MAX = 4, 32  # plain tokens round the ring between looks for a match (prompt lookup)


@dataclass
class SpecConfig:
    drafter: Drafter
    k: int | None = None  # fixed K; None = chosen per round by the K policy
    k_max: int = K_MAX
    depth: int | None = None  # verify frames in flight per stream; None = chosen at run time


@dataclass
class DraftHandle:
    session: DraftSession
    ready: Future[float] | None  # the draft's prefill of the prompt (its seconds), if it has one
    deferred: list[int] | None = None  # a prompt whose prefill waits for :meth:`Speculator.start_prefill`


@dataclass
class SpecCounters:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0
    ring_tokens: int = 0  # plain tokens decoded round the ring (K=auto settled on plain)
    declined: int = 0  # requests that ran without the draft: its prefill would not have paid

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def summary(self) -> dict[str, float | int]:
        """What a user is shown: rounds with drafts, drafts sent, drafts the target kept, their
        share, the mean K of a drafted round, and tokens decoded plainly round the ring."""
        return {
            "rounds": self.rounds,
            "drafted": self.proposed,
            "accepted": self.accepted,
            "acceptance": round(self.acceptance, 3),
            "mean_k": round(self.proposed / self.rounds, 2) if self.rounds else 0.0,
            "ring_tokens": self.ring_tokens,
        }


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
        k = self.stats.next_k(remaining)
        if k > 0 and getattr(self.cfg.drafter, "self_bounded", False):
            # proposals that cost nothing and stop where the drafter's own record says they stop
            # paying (prompt lookup): long where the answer copies its input, none where it
            # does not. The policy's K judged by the average acceptance would cut the copies.
            k = max(k, min(self.stats.k_max, remaining - 1))
        return k

    def _min_conf(self, k: int, k_override: int | None, conf_override: float | None) -> float:
        """How sure the draft must stay to keep drafting: 0 (draft all K) for a fixed K."""
        if conf_override is not None:
            return conf_override
        if k_override is not None or self.cfg.k is not None:
            return 0.0
        return self.stats.threshold(min(k, self.stats.last_k))  # the bar at the policy's own K

    def _gated_costs(self, k_override: int | None) -> SpecCosts | None:
        """The costs to decide a round by its own match, where that is how rounds are decided:
        a free drafter that bounds its own proposals (prompt lookup) under K=auto, once a verify
        position and plain decoding round the ring are timed. A match that pays gets a round
        (:func:`match_round_pays`); elsewhere a short plain run round the ring."""
        if not self._auto(k_override) or not getattr(self.cfg.drafter, "self_bounded", False):
            return None
        if self.stats.extra_s is None or self.stats.ring_s is None:
            return None
        return self.stats.costs()

    def _auto(self, k_override: int | None) -> bool:
        """Whether K is the policy's to choose."""
        return k_override is None and self.cfg.k is None

    def open_session(
        self,
        prompt: Sequence[int],
        k_override: int | None = None,
        max_tokens: int | None = None,
        *,
        defer: bool = False,
    ) -> DraftHandle | None:
        """A draft session for a new stream, or None where the stream had better decode plain
        throughout (round the ring): the policy speculates, but this request is too short to
        repay the draft model's prefill of its prompt. The prefill starts now, beside the
        target's, where the stream will speculate from its first rounds (a fixed K, or the
        policy speculating or still unsure); else the draft catches up on the context if a
        probe ever needs it. ``defer``: the draft shares stage 0's cores, so its prefill waits
        for :meth:`start_prefill` (once stage 0 is done with the prompt) rather than slow
        stage 0's down."""
        session = self.cfg.drafter.session()
        prefill = getattr(session, "prefill", None)
        auto = self._auto(k_override)
        speculating = auto and self.stats.speculating
        if prefill is not None and speculating and max_tokens and not self.stats.draft_pays(len(prompt), max_tokens):
            session.close()
            self.counters.declined += 1
            return None
        eager = not auto or self.stats.step_s is None or speculating
        if prefill is None or not eager:
            return DraftHandle(session, None)
        if defer:
            return DraftHandle(session, None, list(prompt))
        return DraftHandle(session, self._pool.submit(_timed, prefill, list(prompt)))

    def start_prefill(self, handle: DraftHandle) -> None:
        """Start a deferred prefill of the draft (at most once)."""
        prefill = getattr(handle.session, "prefill", None)
        if handle.deferred is not None and handle.ready is None and prefill is not None:
            handle.ready = self._pool.submit(_timed, prefill, handle.deferred)
        handle.deferred = None

    def depth(self) -> int:
        """Verify frames a stream keeps in flight: 2 (draft ahead while one travels) once a
        round trip is measured to take longer than drafting K tokens, else 1."""
        if self.cfg.depth is not None:
            return self.cfg.depth
        c = self.stats.costs()
        if c is None or self.stats.last_k == 0:
            return 1
        return 2 if c.step_s > c.draft_s * max(1, self.stats.last_k) else 1

    async def async_decode(
        self,
        stream: str,
        handle: DraftHandle,
        prompt: Sequence[int],
        first: int,
        *,
        first_logprobs: TokenLogprobs | None = None,
        max_tokens: int,
        sampling: SamplingSpec,
        stop: Sequence[int] = (),
        k_override: int | None = None,
        depth_override: int | None = None,
        conf_override: float | None = None,
        counters: SpecCounters | None = None,
    ) -> AsyncGenerator[tuple[int, TokenLogprobs | None], None]:
        """Tokens after the prefill (whose token is ``first``, with ``first_logprobs``), ``first``
        included, each with its log-probabilities (None where the sampling does not ask).

        ``fed`` lists what went into the target since the last rejection; the output at
        ``fed[v]`` is the target's token after it, which confirms ``fed[v + 1]`` (a draft) or
        replaces it. With depth 2 the next frame, drafted on from unconfirmed drafts, is sent
        while one is still travelling; a rejection voids every position after it, in flight
        or not, and the next frame's ``rollback`` masks them all at once. A frame is drafted
        ahead only while the draft is sure enough of every frame still travelling.

        Where the policy (K=auto) settles on plain decoding, the plain rounds up to its next
        look at speculation run round the ring (``Fwd.auto``), as a plain stream's do: no
        coordinator hop per token. ``stop`` ids end such a run early. ``counters``: this
        request's own figures (the speculator's own add up every request's).
        """
        tallies = (self.counters,) if counters is None else (self.counters, counters)
        session = handle.session
        if handle.ready is not None:  # the draft's prefill: not a cost of any round, but of the request
            t0 = time.perf_counter()
            seconds = await asyncio.wrap_future(handle.ready)
            self.stats.observe_prefill(len(prompt), seconds, waited=time.perf_counter() - t0)
        ctx = [*prompt, first]  # confirmed tokens
        yield first, first_logprobs
        run_len = RUN_MIN  # plain tokens round the ring before a match-decided round looks again
        last_t = time.perf_counter()  # when the previous result was in
        emitted = 1
        feed: list[int] = [first]  # confirmed tokens the target has not seen yet
        fed: list[int] = []
        v = 0
        rollback = 0
        # (result, positions, drafts, sent at, nothing ahead of it, the draft's confidence in it,
        # the drafter's note on the proposal)
        inflight: collections.deque[tuple[asyncio.Future[tuple[int, ...]], int, int, float, bool, float, object]] = (
            collections.deque()
        )
        # frames voided by a rejection while still travelling: the stages compute them anyway, so
        # a frame sent before they come back queues behind them and its time is no round time
        voided: list[asyncio.Future[tuple[int, ...]]] = []
        try:
            while emitted < max_tokens:
                depth = depth_override or self.depth()
                # drafting ahead where the depth is ours to choose: only while it likely pays
                bar_ahead = self.stats.ahead_bar() if (depth_override or self.cfg.depth) is None else 0.0
                ring = 0
                while len(inflight) < depth:
                    room = max_tokens - emitted - (len(fed) - v) - len(feed)  # outputs still useful
                    gated = self._gated_costs(k_override) if not inflight and room > 0 else None
                    if gated is not None:  # this round is decided by its own match (below)
                        k = min(self.stats.k_max, room)
                        min_conf = conf_override if conf_override is not None else match_bar(gated)
                    else:
                        k = self._next_k(room + 1, k_override) if room > 0 else 0
                        if k == 0 and not inflight and self._auto(k_override):
                            ring = self.stats.plain_rounds(room + 1)
                            if ring > 1:
                                break
                        min_conf = self._min_conf(k, k_override, conf_override)
                    ahead = math.prod(f[5] for f in inflight)  # the chance the frames in flight are accepted whole
                    if inflight and ahead < max(min_conf, bar_ahead):
                        break  # a frame drafted on from them would most likely be voided
                    drafts: list[int] = []
                    conf = 1.0
                    note: object = None
                    if k > 0:
                        t0 = time.perf_counter()
                        bar = min_conf / ahead if ahead > 0 else 1.0
                        got = await self._run(functools.partial(session.propose, ctx + fed[v + 1 :], k, bar))
                        drafts = list(got or [])[:k]
                        dt = time.perf_counter() - t0
                        if session.caught_up <= 2:
                            self.stats.observe_draft(dt, len(drafts))
                        else:  # the draft first caught up on plain rounds: a cost of probing, not of speculating
                            last_t += dt
                            self.stats.charge_probe(dt)
                        # a drafter that cannot say how sure it is: the measured rate
                        said = session.confidence
                        conf = said if said is not None else self.stats.acceptance ** len(drafts)
                        note = session.last_proposal
                    if gated is not None:
                        if drafts and match_round_pays(gated, len(drafts), conf):
                            run_len = RUN_MIN
                        else:  # no match worth a round: plain round the ring, then look again
                            ring = min(room + 1, run_len)
                            run_len = min(2 * run_len, RUN_MAX)  # less often while nothing matches
                            break
                    tokens = feed + drafts
                    if not tokens:
                        break
                    step = self.pipeline.send_step(
                        stream,
                        tokens,
                        rollback=rollback,
                        logits=range(len(tokens)) if drafts else (),
                        sampling=sampling,
                    )  # on the wire now: the rollback below may count on it
                    voided = [f for f in voided if not f.done()]
                    alone = not inflight and not voided
                    inflight.append((step, len(tokens), len(drafts), time.perf_counter(), alone, conf, note))
                    feed, rollback = [], 0
                    fed += tokens
                    for c in tallies:
                        c.proposed += len(drafts)
                        c.rounds += 1 if drafts else 0
                if ring > 1:  # plain rounds, round the ring
                    q = await self.pipeline.async_run(
                        stream, feed, start=False, auto=ring - 1, stop=stop, sampling=sampling, rollback=rollback
                    )
                    feed, rollback = [], 0
                    prev: float | None = None
                    try:
                        for _ in range(ring):
                            t, lp = run_step(await q.get())
                            now = time.perf_counter()
                            if prev is not None:  # the first token's time includes the hop from here
                                self.stats.observe_ring(now - prev)
                            self.stats.observe_yield(False, 1, now - last_t)
                            prev = last_t = now
                            ctx.append(t)
                            for c in tallies:
                                c.ring_tokens += 1
                            yield t, lp
                            emitted += 1
                            if emitted >= max_tokens or t in stop:
                                return
                    finally:
                        self.pipeline.end_run(stream)
                    feed = [t]  # the run's last token: not fed yet
                    continue
                task, n, proposed, t0, alone, _, note = inflight.popleft()
                toks = await task
                if alone:  # a round time only when nothing queued ahead of it
                    self.stats.observe_step(n, time.perf_counter() - t0, self.pipeline.busy_s.get(stream, 0.0))
                if len(toks) != n:
                    raise RuntimeError(f"the last stage returned {len(toks)} tokens for {n} positions")
                lps = logprobs_of(toks)
                accepted = yielded = 0
                now = time.perf_counter()
                for i, t in enumerate(toks):
                    ctx.append(t)
                    yield t, lps[i] if lps is not None else None
                    emitted += 1
                    yielded += 1
                    if emitted >= max_tokens:
                        return
                    if v + 1 < len(fed) and fed[v + 1] == t:  # a draft confirmed: it is in the KV already
                        v += 1
                        accepted += 1
                        continue
                    # the target's own token: a correction (void everything fed after fed[v]) or the bonus
                    rollback = len(fed) - (v + 1)
                    feed, fed, v = [t], [], 0
                    break
                for c in tallies:
                    c.accepted += accepted
                self.stats.observe_yield(proposed > 0, yielded, now - last_t)
                last_t = now
                if proposed:  # (a frame's last output confirms the next frame's first draft: near enough)
                    self.stats.observe_accept(proposed, min(accepted, proposed))
                    session.verified(note, proposed, min(accepted, proposed))
                if feed:  # frames still travelling carry voided positions: their results are dropped
                    for task, *_ in inflight:
                        task.add_done_callback(_discard)
                        voided.append(task)
                    inflight.clear()
        finally:
            for task in [*(f[0] for f in inflight), *voided]:
                task.cancel()
            session.close()


def _timed(fn: Callable[[list[int]], object], arg: list[int]) -> float:
    """Run ``fn(arg)``; its seconds."""
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0


def _discard(fut: asyncio.Future[tuple[int, ...]]) -> None:
    """A voided frame's result or error: nobody wants it."""
    if not fut.cancelled():
        fut.exception()
