"""The split planner: a pure function, tested table-driven."""

from __future__ import annotations

import pytest

from coordinator.planner import ModelCosts, PlanError, balanced_split, split_from_cuts


@pytest.mark.parametrize(
    ("costs", "stages", "speeds", "expected"),
    [
        # equal layers, no head: equal thirds
        (ModelCosts(30, layer=1.0, head=0.0), 3, None, [(0, 10), (10, 20), (20, 30)]),
        # one stage takes everything
        (ModelCosts(24, layer=1.0, head=9.0), 1, None, [(0, 24)]),
        # a heavy lm_head (Qwen2.5-0.5B: about 9 layers' worth) pulls layers off the last stage
        (ModelCosts(24, layer=1.0, head=9.0), 2, None, [(0, 16), (16, 24)]),
        (ModelCosts(24, layer=1.0, head=9.0), 3, None, [(0, 11), (11, 22), (22, 24)]),
        # SmolLM2-135M's measured proportions (head = 8 layers)
        (ModelCosts(30, layer=3538944.0, head=28311552.0), 2, None, [(0, 19), (19, 30)]),
        # a node twice as fast gets twice the work
        (ModelCosts(30, layer=1.0, head=0.0), 2, [2.0, 1.0], [(0, 20), (20, 30)]),
        (ModelCosts(30, layer=1.0, head=0.0), 2, [1.0, 2.0], [(0, 10), (10, 30)]),
        # as many stages as layers
        (ModelCosts(3, layer=1.0, head=0.0), 3, None, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_balanced_split(
    costs: ModelCosts, stages: int, speeds: list[float] | None, expected: list[tuple[int, int]]
) -> None:
    got = balanced_split(costs, stages, speeds)
    assert got == expected
    # contiguous, non-empty, covering every layer
    assert got[0][0] == 0 and got[-1][1] == costs.n_layers
    assert all(a < b for a, b in got)
    assert all(got[i][1] == got[i + 1][0] for i in range(len(got) - 1))


def test_balanced_split_minimises_the_slowest_stage() -> None:
    costs = ModelCosts(24, layer=1.0, head=9.0)
    best = max(costs.stage_cost(a, b) for a, b in balanced_split(costs, 2))
    for cut in range(1, 24):
        assert best <= max(costs.stage_cost(0, cut), costs.stage_cost(cut, 24))


@pytest.mark.parametrize(
    ("stages", "speeds", "message"),
    [
        (0, None, "at least one stage"),
        (31, None, "cannot split 30 layers into 31 stages"),
        (2, [1.0], "one positive speed per stage"),
        (2, [1.0, 0.0], "one positive speed per stage"),
    ],
)
def test_balanced_split_errors(stages: int, speeds: list[float] | None, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        balanced_split(ModelCosts(30, layer=1.0, head=1.0), stages, speeds)


@pytest.mark.parametrize(
    ("cuts", "expected"),
    [
        ([16], [(0, 16), (16, 30)]),
        ([10, 20], [(0, 10), (10, 20), (20, 30)]),
        ([1, 29], [(0, 1), (1, 29), (29, 30)]),
    ],
)
def test_split_from_cuts(cuts: list[int], expected: list[tuple[int, int]]) -> None:
    assert split_from_cuts(30, cuts) == expected


@pytest.mark.parametrize("cuts", [[0], [30], [40], [20, 10], [10, 10], [-1]])
def test_split_from_cuts_rejects_bad_points(cuts: list[int]) -> None:
    with pytest.raises(PlanError, match=r"increasing and inside 1\.\.29"):
        split_from_cuts(30, cuts)
