"""How the coordinator cuts a prompt into prefill frames that flow through the ring together."""

from __future__ import annotations

import pytest

from coordinator.batching.scheduler import PREFILL_CHUNK, prefill_chunks


@pytest.mark.parametrize(
    ("n", "stages", "want"),
    [
        (0, 3, []),
        (1, 1, [1]),
        (31, 3, [31]),  # a very short prompt: one frame, whatever the stages
        (40, 3, [20, 20]),  # a short one: a piece a stage, none under 16 tokens
        (48, 2, [24, 24]),
        (255, 2, [128, 127]),  # more pieces than stages would be under 128 tokens each
        (300, 3, [100] * 3),
        (256, 2, [128, 128]),
        (301, 2, [151, 150]),
        (600, 2, [150] * 4),  # two pieces a stage
        (600, 3, [150] * 4),  # ... but none under 128 tokens
        (1000, 3, [167, 167, 167, 167, 166, 166]),
        (600, 1, [600]),  # one stage: nothing to overlap
        (2500, 1, [834, 833, 833]),  # ... but still no frame over the cap
        (5000, 2, [1000] * 5),
    ],
)
def test_prefill_chunks(n: int, stages: int, want: list[int]) -> None:
    assert prefill_chunks(n, stages) == want


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1023, 1024, 1025, 4097])
@pytest.mark.parametrize("stages", [1, 2, 3, 5])
def test_prefill_chunks_cover_the_prompt_within_the_frame_cap(n: int, stages: int) -> None:
    sizes = prefill_chunks(n, stages)
    assert sum(sizes) == n
    assert all(0 < s <= PREFILL_CHUNK for s in sizes)
    assert max(sizes) - min(sizes) <= 1
