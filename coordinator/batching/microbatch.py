"""The micro-batch policy: which streams' tokens ride in the next micro-batch (pure, no I/O).

How the scheduler uses it (issue 39). The scheduler keeps, per stream, its tokens so far
(prompt and generated), its arrival number and what it has sent; for the ring, a ledger of KV
blocks (the smallest stage pool's size, less every block granted). Whenever something changes
(a request admitted, a micro-batch's answer back, a stream cancelled) it calls
:func:`next_batch` until it answers None, and sends each :class:`Plan` as one
:class:`~agent.protocol.batch.Batch` frame into stage 0: the frame travels the ring, one frame
per micro-batch per hop, each stage computing all its parts in one infer call. About S
micro-batches are out at once (S stages), so every stage is busy and each stage step still
batches about U/S streams. The scheduler numbers each plan: that number is the frame's
``Batch.seq`` and its streams' ``in_flight``. Each :class:`PartPlan` becomes a ``Part`` (its
stream's step counter and sampling added; ``n`` rows: a prefill chunk's prompt
tokens, a decode step's last token, or a verify's last token and its first ``drafts`` drafts).
The last stage answers one :class:`~agent.protocol.batch.BatchIds` with every part's tokens;
those streams are ready again.

Speculation is a part of K+1 rows that asks for K+1 tokens; the coordinator checks the drafts
as today and gives the stream ``rollback`` = rejected drafts, carried by its next part (the
stage drops them first, freeing whole blocks). The ledger moves by each part's ``grant`` when
the frame is sent (negative: a rollback gave blocks back), and by a stream's ``blocks`` when it
ends. A preempted stream is closed on every stage (its blocks return to the ledger once they
have all closed it) and becomes a new prompt of its tokens so far, keeping its arrival number,
so it is recomputed first when blocks allow. Failover replay is the same re-prefill: after a
re-plan every stream is such a prompt on the new pools, chunked under the token budget like
any other, so a replay never stalls the streams already running again. A request that arrives
goes through :func:`admit` first: it joins the streams (and starts at the next step that has
room), or the API answers 503 with Retry-After when the admission queue is full.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from agent.protocol.batch import MAX_PARTS
from agent.protocol.codec import MAX_TOKENS_PER_FRAME
from agent.runtime.blocks import blocks_for

DECODE, VERIFY, PREFILL = "decode", "verify", "prefill"


@dataclass(frozen=True)
class StreamState:
    """One active stream, as the scheduler sees it between micro-batches."""

    stream: str
    arrival: int  # admission order, lower is older; kept through a preemption
    prefill: int = 0  # prompt tokens not yet sent (after a preemption: every token so far)
    context: int = 0  # positions in its KV cache once its in-flight part lands (0: not started)
    blocks: int = 0  # KV blocks it holds on each stage (the ledger's count)
    in_flight: int | None = None  # the micro-batch it rides in; None: its last answer is back
    k: int = 0  # drafts to verify in its next decode step (0: a plain 1-token step)
    rollback: int = 0  # rejected drafts of its previous verify, dropped before its next part
    ready_since: int = 0  # when its last answer came back (or it arrived): who has waited longest

    @property
    def started(self) -> bool:
        """Whether its stages know it (it has positions in their caches)."""
        return self.context > 0


@dataclass(frozen=True)
class RingState:
    stages: int
    token_budget: int  # rows one stage step takes (the smallest max_step_tokens of the stages)
    free_blocks: int  # free KV blocks of the smallest pool, net of every grant already sent
    total_blocks: int  # that pool's size
    block_size: int
    in_flight: int = 0  # micro-batches out on the ring
    max_in_flight: int = 0  # 0: as many as stages
    max_streams: int = MAX_PARTS  # streams started on the ring at once


@dataclass(frozen=True)
class SchedState:
    ring: RingState
    streams: tuple[StreamState, ...]


@dataclass(frozen=True)
class PartPlan:
    """One stream's part of the next micro-batch."""

    stream: str
    kind: str  # decode, verify or prefill
    n: int  # new positions (rows)
    logits: int  # tokens it asks for: 1 for a decode and a prompt's last chunk, n for a verify
    rollback: int  # its previous verify's rejected drafts, dropped first
    start: bool  # its first part since it started or was preempted
    blocks: int  # its blocks once this part is in the cache
    grant: int  # blocks - what it held: taken from the ledger (negative: given back)

    @property
    def drafts(self) -> int:
        """Drafts this part verifies (maybe fewer than its K when the budget or blocks are short)."""
        return self.n - 1 if self.kind == VERIFY else 0


@dataclass(frozen=True)
class Plan:
    parts: tuple[PartPlan, ...] = ()
    preempt: tuple[str, ...] = ()  # close these on every stage; recompute them from their tokens
    waiting: tuple[str, ...] = ()  # had work, but not the blocks for it: they wait
    too_long: tuple[str, ...] = ()  # their next step needs more blocks than the pool holds: fail them

    @property
    def rows(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def grant(self) -> int:
        return sum(p.grant for p in self.parts)


class StateError(ValueError):
    """A scheduler state that cannot be right (a stream twice, negative counts, an empty stream)."""


def check(state: SchedState) -> None:
    """Raise :class:`StateError` naming the first inconsistency in ``state``."""
    r = state.ring
    if r.stages < 1 or r.block_size < 1 or r.total_blocks < 1:
        raise StateError(
            f"a ring needs stages, blocks and a block size, not {r.stages}/{r.total_blocks}/{r.block_size}"
        )
    if not 1 <= r.token_budget <= MAX_TOKENS_PER_FRAME:
        raise StateError(f"token budget {r.token_budget} is not within 1..{MAX_TOKENS_PER_FRAME}")
    if not 0 <= r.free_blocks <= r.total_blocks:
        raise StateError(f"{r.free_blocks} free blocks of {r.total_blocks}")
    if r.in_flight < 0 or r.max_in_flight < 0 or not 1 <= r.max_streams <= MAX_PARTS:
        raise StateError(f"in flight {r.in_flight}, at most {r.max_in_flight}; streams at most {r.max_streams}")
    seen: set[str] = set()
    batches: set[int] = set()
    for s in state.streams:
        if s.stream in seen:
            raise StateError(f"stream {s.stream!r} is listed twice")
        seen.add(s.stream)
        if min(s.prefill, s.context, s.blocks, s.k, s.rollback) < 0:
            raise StateError(f"stream {s.stream!r}: a negative count")
        if s.prefill == 0 and s.context == 0:
            raise StateError(f"stream {s.stream!r} has neither a prompt to send nor a context")
        if s.rollback > s.context or blocks_for(s.context, r.block_size) > s.blocks:
            raise StateError(f"stream {s.stream!r}: context {s.context} does not fit its {s.blocks} block(s)")
        if s.in_flight is not None:
            batches.add(s.in_flight)
    if len(batches) > r.in_flight:
        raise StateError(f"streams ride in {len(batches)} micro-batches, but {r.in_flight} are in flight")


def _order(streams: Sequence[StreamState]) -> list[StreamState]:
    """Ready streams in the order they are served: decode steps first, the longest waiting first
    (then the oldest), then prompts already begun, then new prompts, each oldest first."""
    ready = [s for s in streams if s.in_flight is None]
    decodes = sorted((s for s in ready if s.prefill == 0), key=lambda s: (s.ready_since, s.arrival))
    prompts = sorted((s for s in ready if s.prefill > 0), key=lambda s: (not s.started, s.arrival))
    return decodes + prompts


@dataclass
class _Fill:
    parts: list[PartPlan]
    waiting: list[str]
    too_long: list[str]


def _fill(ring: RingState, order: Sequence[StreamState], share: int, started: int) -> _Fill:
    """Parts for ``order`` under the token budget, the parts cap and the free blocks.

    A stream that cannot get the blocks for even one token waits, and so does every stream after
    it that would need new blocks (the blocks it was short of go to no one behind it).
    """
    bs = ring.block_size
    budget, free, short = ring.token_budget, ring.free_blocks, False
    out = _Fill([], [], [])
    for s in order:
        if len(out.parts) >= share or budget == 0:
            break
        length = s.context - s.rollback
        final = length + s.prefill + 1  # positions once its prompt is in and one token more
        if blocks_for(final, bs) > ring.total_blocks:
            out.too_long.append(s.stream)
            continue
        avail = 0 if short else free
        if not s.started:
            if started >= ring.max_streams:
                break  # the rest are new prompts too: no stream slot for them until one ends
            if blocks_for(final, bs) > avail:  # a new prompt starts with its whole prompt's blocks free
                short = True
                out.waiting.append(s.stream)
                continue
            started += 1
        want = min(s.prefill, budget) if s.prefill else min(1 + s.k, budget)
        n = min(want, (s.blocks + avail) * bs - length)
        if n < 1:
            short = True
            out.waiting.append(s.stream)
            continue
        blocks = blocks_for(length + n, bs)
        if s.prefill:
            kind, logits = PREFILL, (1 if n == s.prefill else 0)
        else:
            kind, logits = (VERIFY if n > 1 else DECODE), n
        out.parts.append(PartPlan(s.stream, kind, n, logits, s.rollback, not s.started, blocks, blocks - s.blocks))
        free -= max(0, blocks - s.blocks)  # blocks a rollback frees count from the next micro-batch on
        budget -= n
    return out


def _victims(streams: Sequence[StreamState], oldest: StreamState, need: int) -> list[StreamState] | None:
    """The newest started streams, not in flight, whose blocks cover ``need``; None if they cannot."""
    chosen, freed = [], 0
    candidates = [s for s in streams if s.started and s.in_flight is None and s.arrival > oldest.arrival]
    for s in sorted(candidates, key=lambda s: s.arrival, reverse=True):
        if freed >= need:
            break
        chosen.append(s)
        freed += s.blocks
    return chosen if freed >= need else None


def next_batch(state: SchedState) -> Plan | None:
    """The next micro-batch to send, or None when there is nothing to do until an answer comes back.

    Ready decode steps go first (n = 1, or K+1 for a verify, fewer drafts when the budget or the
    blocks are short), then prompt chunks fill the rest of the token budget (dynamic split-fuse:
    a long prompt goes a chunk at a time; its last chunk asks for 1 token). A micro-batch takes at
    most its share of the streams, about U/S, so that S micro-batches keep S stages busy. A
    stream rides in at most one micro-batch in flight. A new prompt starts only when the free
    blocks hold all of it; when blocks run out the streams served last wait. When even the
    oldest started stream cannot take one more token, the newest started streams are preempted
    until their blocks cover it: the plan names them and leaves the freed blocks unused, so the
    oldest goes in a micro-batch sent after every stage has closed them.
    """
    check(state)
    ring, streams = state.ring, state.streams
    cap = ring.max_in_flight or ring.stages
    if ring.in_flight >= cap or all(s.in_flight is not None for s in streams):
        return None
    share = min(ring.max_streams, math.ceil(len(streams) / cap))
    started = sum(s.started for s in streams)
    order = _order(streams)
    fill = _fill(ring, order, share, started)
    running = [s for s in streams if s.started and s.stream not in fill.too_long]
    oldest = min(running, key=lambda s: s.arrival, default=None)
    preempt: list[str] = []
    if oldest is not None and oldest.stream in fill.waiting:
        fill = _fill(ring, [oldest] + [s for s in order if s is not oldest], share, started)
        if oldest.stream in fill.waiting:  # short even with every free block: make room
            need = blocks_for(oldest.context - oldest.rollback + 1, ring.block_size) - oldest.blocks - ring.free_blocks
            victims = _victims(streams, oldest, need) or []
            preempt = [v.stream for v in victims]
            fill.parts = [p for p in fill.parts if p.stream not in preempt]
            fill.waiting = [w for w in fill.waiting if w not in preempt]
    if not (fill.parts or preempt or fill.too_long):
        return None
    return Plan(tuple(fill.parts), tuple(preempt), tuple(fill.waiting), tuple(fill.too_long))


# admission ----------------------------------------------------------------------------------
JOIN, QUEUE, REJECT, TOO_LONG = "join", "queue", "reject", "too_long"
RETRY_MIN_S, RETRY_MAX_S, RETRY_UNKNOWN_S = 1, 60, 5


@dataclass(frozen=True)
class QueueState:
    """What admission knows when a request arrives."""

    prompt: int  # the new request's prompt tokens
    waiting: int  # requests admitted that have not started (no blocks yet): the admission queue
    started: int  # streams started on the ring
    free_blocks: int  # as RingState: the smallest pool's free blocks, net of grants
    total_blocks: int
    block_size: int
    max_streams: int = MAX_PARTS
    finished_per_s: float = 0.0  # requests finished per second lately (0: not measured yet)


@dataclass(frozen=True)
class Admission:
    verdict: str  # join (starts at the next step), queue (waits its turn), reject (503), too_long
    retry_after_s: int = 0  # reject: the Retry-After header, whole seconds
    reason: str = ""


def admit(queue: QueueState, limit: int) -> Admission:
    """Whether a new request joins the next step, waits in the admission queue, or is refused.

    It joins when nothing waits ahead of it and the ring has a stream slot and the blocks for
    its whole prompt; it queues while the queue is under ``limit``; past that the API answers
    503 with Retry-After, the time the recent finishing rate takes to free a place in the
    queue. A prompt that the smallest pool cannot hold at all is refused for good (too_long).
    """
    if queue.prompt < 1 or queue.block_size < 1 or limit < 0:
        raise StateError(f"prompt {queue.prompt}, block size {queue.block_size}, limit {limit}")
    need = blocks_for(queue.prompt + 1, queue.block_size)
    if need > queue.total_blocks:
        room = queue.total_blocks * queue.block_size - 1
        return Admission(TOO_LONG, reason=f"a {queue.prompt}-token prompt; this cluster holds at most {room}")
    if queue.waiting == 0 and queue.started < queue.max_streams and need <= queue.free_blocks:
        return Admission(JOIN)
    if queue.waiting < limit:
        return Admission(QUEUE, reason=f"{queue.waiting} request(s) ahead")
    ahead = queue.waiting - limit + 1
    rate = queue.finished_per_s
    est = math.ceil(ahead / rate) if rate > 0 else RETRY_UNKNOWN_S
    retry = max(RETRY_MIN_S, min(RETRY_MAX_S, est))
    return Admission(REJECT, retry, f"the admission queue is full ({queue.waiting} waiting)")
