"""The batcher's admission gate: whether a new request is taken now and, if not, why.

It keeps when recent requests finished (the rate the admission queue drains at), adds that to
the ring's occupancy that :class:`~coordinator.batching.batcher.Batcher` reports, and asks the
pure policy (:func:`~coordinator.batching.microbatch.admit`). A refusal is the
:class:`~coordinator.ring.pipeline.PipelineError` the API answers: ``overloaded`` (503 with
``retry_after``) while the queue is full, ``context_length_exceeded`` for a prompt that no pool
could ever hold.
"""

from __future__ import annotations

import asyncio

from coordinator.batching.microbatch import JOIN, QUEUE, TOO_LONG, QueueState, admit
from coordinator.ring.pipeline import PipelineError, RingCapacity

RATE_WINDOW_S = 60.0  # requests that finished longer ago than this no longer count toward the rate


class AdmissionGate:
    """Admission of new requests into a batcher's streams, and the finishes it counts."""

    def __init__(self) -> None:
        self._finished: list[float] = []  # when recent requests finished (the loop's clock)

    def finished(self) -> None:
        """A request is over (answered, failed, or its client left): one more finish counted."""
        self._finished.append(asyncio.get_running_loop().time())

    def refusal(
        self,
        prompt: int,
        cap: RingCapacity,
        *,
        waiting: int,
        started: int,
        free_blocks: int,
        max_streams: int,
        limit: int,
    ) -> PipelineError | None:
        """Why a request of ``prompt`` tokens cannot be taken now (None: it can), given the ring's
        capacity, its streams (``waiting`` for blocks or a slot, ``started``), its free blocks, and
        the admission queue's ``limit``."""
        q = QueueState(
            prompt=prompt,
            waiting=waiting,
            started=started,
            free_blocks=free_blocks,
            total_blocks=cap.total_blocks,
            block_size=cap.block_size,
            max_streams=max_streams,
            finished_per_s=self.rate(),
        )
        verdict = admit(q, limit)
        if verdict.verdict == TOO_LONG:
            return PipelineError(verdict.reason, "context_length_exceeded")
        if verdict.verdict not in (JOIN, QUEUE):
            return PipelineError(verdict.reason, "overloaded", retry_after=verdict.retry_after_s)
        return None

    def rate(self) -> float:
        """Requests finished per second lately (0.0: fewer than two finishes to go by)."""
        now = asyncio.get_running_loop().time()
        self._finished = [t for t in self._finished if now - t < RATE_WINDOW_S]
        if len(self._finished) < 2:
            return 0.0
        return len(self._finished) / max(1.0, now - self._finished[0])
