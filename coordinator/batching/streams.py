"""A batching ring's streams as the scheduler keeps them (see :mod:`.batcher`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from agent.protocol import BatchIds
from agent.protocol.batch import Part
from coordinator.batching.drafts import Drafts
from coordinator.batching.microbatch import PartPlan, StreamState
from coordinator.batching.prefix import PrefixCache
from coordinator.batching.scheduler import GenRequest


@dataclass
class Stream:
    name: str  # its stream id on the ring
    req: GenRequest
    arrival: int
    tokens: list[int]  # prompt and generated so far
    out: asyncio.Queue[int | BaseException | None] = field(default_factory=asyncio.Queue)
    emitted: int = 0
    context: int = 0  # positions in the stages' caches once its part in flight lands
    blocks: int = 0
    started: bool = False
    in_flight: int | None = None  # the micro-batch it rides in
    held: bool = False  # a stage refused its part because the pipeline is going: it waits for the next one
    part: Part | None = None  # its part in that micro-batch
    first_seq: int = 0  # its parts from here on belong to its current start (older errors are stale)
    rollback: int = 0  # positions of rejected drafts its next part drops first
    drafts: Drafts | None = None  # speculating: its draft session and next proposal
    sent_drafts: list[int] = field(default_factory=list)  # the drafts its part in flight verifies
    fork: str | None = None  # the prefix cache entry whose head it shares
    fork_len: int = 0  # positions shared
    shared: int = 0  # blocks shared (the entry's, not its own)
    fork_pending: bool = False  # its first part, which opens it as a fork, is not sent yet
    ready_since: int = 0
    resets: int = 0
    done: bool = False

    @property
    def kept(self) -> int:
        """Positions its stages keep once they drop its rejected drafts."""
        return self.context - self.rollback

    # -- prefix caching -------------------------------------------------------------------
    def fork_from(self, cache: PrefixCache) -> None:
        """Start on the longest cached head of the prompt, if one is cached: the stages share
        that entry's blocks and compute only the rest."""
        hit = cache.lookup(self.tokens)
        if hit is None:
            return
        cache.acquire(hit.entry)
        self.fork, self.fork_len, self.fork_pending = hit.entry, hit.tokens, True
        self.started, self.context = True, hit.tokens
        self.blocks = self.shared = hit.tokens // cache.block_size

    def unfork(self, cache: PrefixCache | None) -> None:
        """No longer share a cached head (its stages' stream is closed or starts over)."""
        if cache is not None:
            cache.release(self.fork)
        self.fork, self.fork_len, self.shared, self.fork_pending = None, 0, 0, False

    def keep_in(self, cache: PrefixCache) -> list[str]:
        """Offer the finished stream's KV as a cached head: the streams to close on the stages
        (itself, when it adds no head, and entries evicted to make room)."""
        return cache.add(self.name, self.tokens[: self.kept], self.blocks - self.shared, parent=self.fork)

    # -- micro-batches ----------------------------------------------------------------------
    def take(self, pp: PartPlan, seq: int) -> tuple[Part, list[int]]:
        """Its part of the next micro-batch as the policy planned it, numbered ``seq``, and the
        part's rows: prompt tokens, its last token, or (a verify) its last token and its drafts."""
        start = pp.start or self.fork_pending  # (a fork is started from the policy's view)
        if pp.start:
            self.started, self.context = True, 0
        if start:
            self.first_seq = seq
        fork = self.fork if self.fork_pending else None
        self.fork_pending = False
        part = Part(
            pp.stream, seq, pp.n, start, pp.rollback, pp.logits, self.req.sampling, fork, self.fork_len if fork else 0
        )
        at = self.kept
        rows = self.tokens[at : at + pp.n]
        self.sent_drafts = []
        if pp.drafts and self.drafts is not None:  # a verify: its last token, then its drafts
            self.sent_drafts = self.drafts.proposal[: pp.drafts]
            rows = rows[:1] + self.sent_drafts
            self.drafts.proposal = []
        self.context, self.rollback = at + pp.n, 0
        self.blocks = pp.blocks
        self.part = part
        return part, rows

    def reset(self, cache: PrefixCache | None) -> None:
        """Forget what its stages held: it starts over from its tokens so far."""
        self.unfork(cache)
        self.started, self.context, self.blocks, self.in_flight, self.part = False, 0, 0, None, None
        self.rollback, self.sent_drafts, self.held = 0, [], False
        if self.drafts is not None:
            self.drafts.proposal = []

    def state(self) -> StreamState | None:
        """As the policy sees it; None while it drafts (it sits this micro-batch out) or is held
        (its stages' state is unknown until the re-planned pipeline starts it over)."""
        if self.held or (self.drafts is not None and self.drafts.busy and self.in_flight is None):
            return None
        pending = len(self.tokens) - self.kept
        prefill = pending if (pending > 1 or not self.started) else 0
        k = len(self.drafts.proposal) if self.drafts is not None and self.started and not prefill else 0
        return StreamState(
            stream=self.name,
            arrival=self.arrival,
            prefill=prefill,
            context=self.context if self.started else 0,
            blocks=self.blocks,
            in_flight=self.in_flight,
            k=k,
            rollback=self.rollback if self.started else 0,
            ready_since=self.ready_since,
        )


@dataclass
class Flight:
    """A micro-batch out on the ring: the streams still waiting for its answer."""

    streams: dict[str, Stream]
    fut: asyncio.Future[BatchIds]
