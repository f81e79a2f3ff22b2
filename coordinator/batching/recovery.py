"""The batcher's failure handling: failed parts and a broken pipeline.

A part that a stage refused (a pool was short after all, the stage lost the stream) starts its
stream over from its tokens so far, at most :data:`MAX_RESETS` times before its request fails.
A broken pipeline (a node lost, a micro-batch that failed) is re-planned through ``recover``,
the coordinator's failover, up to :data:`~coordinator.batching.scheduler.MAX_RECOVERIES` times;
the batcher's ``set_pipeline`` then starts every stream over on the new pipeline. Without a way
to recover, or when re-planning fails, every request fails with the error.

:class:`Recovery` sees the batcher only through what it is given: its streams (read only), its
current pipeline, and how to restart a stream, fail one, and wake the pump.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from coordinator.batching.scheduler import MAX_RECOVERIES, RECOVERABLE
from coordinator.batching.streams import Stream
from coordinator.ring.pipeline import Pipeline, PipelineError

log = logging.getLogger(__name__)
MAX_RESETS = 4  # times one stream is recomputed after its parts failed, before its request fails
# errors of a pipeline that is going: failover starts every stream over, not the part's error
GOING = frozenset({"node_lost", "stale_term", "paused"})


class Recovery:
    """What a batcher does when a part fails or its pipeline breaks (see the module's docstring)."""

    def __init__(
        self,
        streams: Mapping[str, Stream],
        current: Callable[[], Pipeline],
        restart: Callable[[Stream], None],
        fail: Callable[[Stream, PipelineError], None],
        wake: Callable[[], None],
    ) -> None:
        self.recover: Callable[[Pipeline], Awaitable[None]] | None = None
        self.busy = False  # re-planning: the pump plans nothing until it is over
        self._streams = streams
        self._current, self._restart, self._fail, self._wake = current, restart, fail, wake
        self._task: asyncio.Task[None] | None = None

    def part_failed(self, s: Stream, err: PipelineError) -> None:
        """One of ``s``'s parts failed: it starts over, or, past :data:`MAX_RESETS`, its request fails."""
        if err.code in GOING:  # the pipeline is going: failover starts every stream over
            s.held = True  # until then it sits out (no flight, no part: not sent again here)
            s.in_flight, s.part = None, None
            return
        s.resets += 1
        if s.resets > MAX_RESETS:
            self._fail(s, err)
            return
        log.info("stream %s starts over after a failed part: %s", s.name, err)
        self._restart(s)

    def lost(self, err: PipelineError) -> None:
        """The pipeline broke: re-plan it, unless that is already under way."""
        if self.busy:
            return
        self.busy = True
        self._task = asyncio.get_running_loop().create_task(self._async_replan(err))

    async def _async_replan(self, err: PipelineError) -> None:
        """Re-plan (through ``recover``) until the pipeline is a new one; without a way to
        recover, every request fails with the error."""
        failed = self._current()
        try:
            ok = self.recover is not None and (err.code in RECOVERABLE or failed.lost is not None)
            for _ in range(MAX_RECOVERIES if ok else 0):
                try:
                    assert self.recover is not None
                    await self.recover(failed)
                except PipelineError as e:
                    err = e
                    break
                if self._current() is not failed:
                    break
            if self._current() is failed or not ok:
                for s in list(self._streams.values()):
                    self._fail(s, err)
                return
            log.warning("micro-batching resumes on the re-planned pipeline (%d streams)", len(self._streams))
        finally:
            self.busy = False
            self._wake()

    def shutdown(self) -> None:
        """Stop a re-plan under way."""
        if self._task is not None:
            self._task.cancel()
