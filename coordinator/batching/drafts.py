"""Speculative decoding inside micro-batches: each stream's drafts, verified as one K+1-row part.

A speculating stream's decode part carries its last token and up to K drafts; the last stage
answers with the target's token at each of those positions. The drafts the target agrees with,
and its own next token, are the stream's new tokens; the rejected drafts' positions travel as the
stream's next part's ``rollback`` (the stages drop them first, freeing whole blocks). Drafting
runs inference: on one thread of its own, never on the event loop. While a stream drafts, it sits
out the micro-batches; the others go on.

K is fixed per request (the request's, the configuration's, else :data:`K_BATCHED`): in a batch,
what a verify row costs depends on its companions, so K follows no timing, and the same request
proposes the same drafts every time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from coordinator.batching.scheduler import GenRequest
from coordinator.speculative.decoding import SpecConfig, SpecCounters, accept
from coordinator.speculative.drafting import DraftSession

K_BATCHED = 4  # drafts a verify carries when neither the request nor the configuration says


@dataclass
class Drafts:
    """One stream's draft session and its next proposal."""

    session: DraftSession
    k: int
    counters: SpecCounters | None  # the request's own tally (None: not wanted)
    proposal: list[int] = field(default_factory=list)  # drafts ready for its next part
    note: object = None  # what the drafter wants back with the verdict on ``proposal``
    busy: bool = False  # drafting now: the stream waits for it
    closed: bool = False


class BatchDrafter:
    """The draft model (or prompt lookup) of a batching ring, shared by its streams."""

    def __init__(self, cfg: SpecConfig) -> None:
        self.cfg = cfg
        self.counters = SpecCounters()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="draft")

    def open(self, req: GenRequest) -> Drafts | None:
        """A draft session for ``req``, or None where it decodes plainly (it asks for K=0, or
        for logits rather than ids)."""
        k = req.spec_k if req.spec_k is not None else self.cfg.k if self.cfg.k is not None else K_BATCHED
        if k <= 0 or not req.ids_only:
            return None
        return Drafts(self.cfg.drafter.session(), min(k, self.cfg.k_max), req.spec_counters)

    def start(self, d: Drafts, context: Sequence[int], remaining: int, done: Callable[[], None]) -> None:
        """Draft up to K tokens after ``context`` (no more than ``remaining`` - 1: the target's own
        token always comes too); ``done`` is called on the loop once the proposal is ready."""
        d.proposal, d.note = [], None
        k = min(d.k, remaining - 1)
        if k <= 0 or d.closed:
            return
        d.busy = True
        session, ctx = d.session, list(context)

        def work() -> tuple[list[int], object]:
            return session.propose(ctx, k), session.last_proposal

        fut = asyncio.get_running_loop().run_in_executor(self._pool, work)

        def landed(f: asyncio.Future[tuple[list[int], object]]) -> None:
            d.busy = False
            if d.closed:
                return
            if not f.cancelled() and f.exception() is None:
                d.proposal, d.note = f.result()
                d.proposal = d.proposal[:k]
            done()

        fut.add_done_callback(landed)

    def verdict(self, d: Drafts, sent: Sequence[int], target: Sequence[int]) -> int:
        """How many of the drafts ``sent`` the target's tokens ``target`` confirm (counted)."""
        a = accept(sent, target)
        if sent:
            d.session.verified(d.note, len(sent), a)
        for c in (self.counters, d.counters):
            if c is not None and sent:
                c.rounds += 1
                c.proposed += len(sent)
                c.accepted += a
            if c is not None:
                c.tokens += a + 1
        return a

    def close(self, d: Drafts) -> None:
        d.closed = True
        self._pool.submit(d.session.close)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
