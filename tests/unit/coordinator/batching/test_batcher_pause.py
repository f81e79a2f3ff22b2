"""A stage that pauses (its owner touched the laptop) refuses the next part of a stream: that
stream waits for the re-planned pipeline and starts over there, while the scheduler keeps
serving everyone else; every answer is the one it would have been (issue 40's live test found
the scheduler failing every request instead, "streams ride in 1 micro-batches, but 0 are in
flight"). Played on the toy ring of ``test_logprobs_scheduling``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from agent.protocol import BatchIds, Part
from coordinator.batching.batcher import Batcher
from coordinator.batching.scheduler import GenRequest
from coordinator.ring.pipeline import PipelineError
from tests.unit.coordinator.batching.test_logprobs_scheduling import FakeBatchRing, _expected


class PausingRing(FakeBatchRing):
    """Refuses ``victim``'s part in its ``at``-th micro-batch as a paused stage does (an error
    naming the stream, no answer for that frame), and every frame after it."""

    def __init__(self, victim: str, at: int) -> None:
        super().__init__()
        self.victim, self.at, self.sent = victim, at, 0
        self.paused = False

    def send_batch(self, parts: Sequence[Part], ids: Sequence[int]) -> asyncio.Future[BatchIds]:
        self.sent += 1
        if self.paused or (self.sent >= self.at and any(p.stream == self.victim for p in parts)):
            self.paused = True
            loop = asyncio.get_running_loop()
            for p in parts:
                err = PipelineError("this node is paused (user active)", "paused")
                loop.call_soon(self.on_stream_error, p.stream, p.seq, err)
            return loop.create_future()  # no answer ever comes for a refused frame
        return super().send_batch(parts, ids)


def test_a_part_refused_by_a_paused_stage_waits_for_the_new_pipeline_and_loses_nothing() -> None:
    prompts = [(3, 7, 1), (2, 2), (9, 4, 4, 1)]
    reqs = [GenRequest(p, max_tokens=12) for p in prompts]
    ring = PausingRing(victim="s1", at=4)
    batcher = Batcher(ring, prefix_cache=False)  # type: ignore[arg-type]

    async def go() -> list[list[int]]:
        async def one(r: GenRequest) -> list[int]:
            return [t async for t in batcher.async_generate(r)]

        async def replan() -> None:  # what the coordinator's failover does once it sees the pause
            while not ring.paused:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)
            fresh = FakeBatchRing()
            fresh._n = ring._n  # (stream names stay unique)
            batcher.set_pipeline(fresh)  # type: ignore[arg-type]

        try:
            got = await asyncio.wait_for(asyncio.gather(*(one(r) for r in reqs), replan()), 10)
            return list(got[: len(reqs)])
        finally:
            batcher.shutdown()

    got = asyncio.run(go())
    assert ring.paused
    assert got == [[t for t, _ in _expected(p, 12)] for p in prompts]
    assert batcher.replays >= 1
