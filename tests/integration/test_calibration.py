"""Split costs learnt from measured stage times: the fit, the proposal, and a real re-split."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from agent.common import aio
from coordinator.batching.scheduler import GenRequest
from coordinator.lab.local_cluster import LocalCluster
from coordinator.planning.calibration import CalibrationStore, StageTime, fit_head_layers, propose, stage_time
from coordinator.planning.planner import balanced_split, model_costs
from coordinator.service.coordinator import Coordinator
from tests.support.exact import exact_config
from tests.support.figures import report

L = False  # a stage without the head
H = True  # the last stage, with the head


@pytest.mark.parametrize(
    ("stages", "head"),
    [
        # 0.5 ms per layer; the last stage's 2 layers take 1 ms, its head the rest
        ([StageTime(0, 10, L, 5.0), StageTime(10, 20, L, 5.0), StageTime(20, 24, H, 4.0)], 4.0),
        ([StageTime(0, 22, L, 11.0), StageTime(22, 24, H, 5.0)], 8.0),
        ([StageTime(0, 29, L, 29.0), StageTime(29, 30, H, 7.6)], 6.6),
        # body stages of different speeds: the per-layer time is their pooled average
        ([StageTime(0, 10, L, 4.0), StageTime(10, 20, L, 6.0), StageTime(20, 24, H, 4.0)], 4.0),
    ],
)
def test_the_head_is_fitted_in_layers(stages: list[StageTime], head: float) -> None:
    assert fit_head_layers(stages) == pytest.approx(head)


@pytest.mark.parametrize(
    "stages",
    [
        [StageTime(0, 24, H, 10.0)],  # one stage: layers and head cannot be told apart
        [StageTime(0, 12, L, 6.0), StageTime(12, 24, L, 6.0)],  # nobody reported the head
        [StageTime(0, 12, L, 0.0), StageTime(12, 24, H, 6.0)],  # a stage that timed nothing
        [StageTime(0, 22, L, 11.0), StageTime(22, 24, H, 0.9)],  # faster than its own layers: noise
        [StageTime(0, 22, L, 1.0), StageTime(22, 24, H, 90.0)],  # a head worth 1900 layers: noise
    ],
)
def test_no_fit_from_measurements_that_cannot_tell(stages: list[StageTime]) -> None:
    assert fit_head_layers(stages) is None


def _split(n_layers: int, head: float, n: int) -> list[tuple[int, int]]:
    cfg: Any = type("Cfg", (), {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4})
    cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size = 256, n_layers, 1000
    return balanced_split(model_costs(cfg, head), n)


def test_a_lopsided_split_gets_a_better_one_and_a_balanced_one_stays() -> None:
    lopsided = [StageTime(0, 12, L, 6.0), StageTime(12, 20, L, 4.0), StageTime(20, 24, H, 5.0)]  # head = 6 layers
    p = propose(lopsided, 6.0, lambda h: _split(24, h, 3))
    assert p.ranges == [(0, 10), (10, 20), (20, 24)] and p.predicted_ms == pytest.approx(5.0)
    assert p.current_ms == 6.0 and p.pays(0.05)
    even = [StageTime(0, 10, L, 5.0), StageTime(10, 20, L, 5.0), StageTime(20, 24, H, 5.0)]
    p = propose(even, 6.0, lambda h: _split(24, h, 3))
    assert p.ranges == [(0, 10), (10, 20), (20, 24)] and not p.pays(0.05)


@pytest.mark.parametrize(
    ("status", "expect"),
    [
        ({"layers": [0, 10], "stage": 0, "stages": 2, "step_ms_p50": 3.5, "frames": 40}, StageTime(0, 10, L, 3.5)),
        (
            {
                "node": "n1",
                "state": "available",
                "stage": {"layers": [10, 30], "stage": 1, "stages": 2, "step_ms_p50": 2.0, "frames": 99},
            },
            (10, 30, H),
        ),  # a daemon's answer
        ({"layers": [0, 10], "stage": 0, "stages": 2, "step_ms_p50": 3.5, "frames": 5}, None),  # too few steps
        ({"layers": None, "stage": None, "stages": None, "step_ms_p50": None, "frames": 0}, None),  # unassigned
        ({"node": "n1", "state": "available", "stage": {"assigned": False}}, None),  # a daemon serving nothing
        ({"layers": [0, 10], "stage": 3, "stages": 2, "step_ms_p50": 3.5, "frames": 40}, None),  # unreadable
        ({"node": "n1", "state": "available", "stage": {"layers": "0-10", "frames": 40}}, None),  # unreadable
    ],
)
def test_stage_times_read_from_agent_status(status: dict[str, Any], expect: Any) -> None:
    got = stage_time(status)
    if isinstance(expect, tuple):
        assert got is not None and (got.start, got.end, got.last) == expect
    else:
        assert got == expect


def test_the_store_keeps_the_latest_fit_and_shrugs_off_a_bad_file(tmp_path: Path) -> None:
    s = CalibrationStore(tmp_path / "calibration.json")
    assert s.get("m|int4") is None
    s.update("m|int4", 6.5)
    s.update("m|int4", 5.9)
    s.update("other|int8", 8.0)
    assert CalibrationStore(s.path).get("m|int4") == 5.9
    s.path.write_text("{not json")
    assert s.get("m|int4") is None  # re-measured next time rather than failing to plan


def test_the_store_keeps_a_batch_curve_beside_the_head_fit(tmp_path: Path) -> None:
    s = CalibrationStore(tmp_path / "calibration.json")
    assert s.curve("m|int4") is None
    s.update("m|int4", 6.5)
    s.update_curve("m|int4", ((1, 1.0), (2, 1.3), (8, 3.6)))
    again = CalibrationStore(s.path)
    assert again.curve("m|int4") == ((1, 1.0), (2, 1.3), (8, 3.6)) and again.get("m|int4") == 6.5
    assert again.get("m|int4|batch") is None  # a curve is not a head fit
    for bad in ("[[2, 1.3], [8, 3.6]]", "[[1, 1.0], [8, 3.6], [4, 2.0]]", '"steep"', "[[1, 1.0], [2]]"):
        s.path.write_text('{"m|int4|batch": ' + bad + "}")
        assert s.curve("m|int4") is None, bad  # planned per stream rather than on a bad curve


_terms = itertools.count(1)


def test_a_wrong_cost_model_is_corrected_from_measured_stage_times(smollm2, smollm2_tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A stored head cost of 40 layers splits SmolLM2 29|1; measured, the coordinator re-splits
    it mid-service, and the text stays the same (exact mode)."""
    prompt = tuple(smollm2_tokenizer.chat_ids([{"role": "user", "content": "Describe a lighthouse at night."}]))

    async def go(nodes: list[str]) -> tuple[Any, ...]:
        cfg = exact_config(smollm2, nodes, next(_terms) * 100, failover=False)
        coord = Coordinator(cfg)
        coord.calibration = CalibrationStore(tmp_path / "calibration.json")
        coord.calibration.update("smollm2-135m|int8", 40.0)
        await coord.async_start()
        try:
            sched = coord.scheduler
            assert sched is not None and coord.export is not None

            async def gen() -> list[int]:
                return [t async for t in sched.async_generate(GenRequest(prompt=prompt, max_tokens=40))]

            before = [m["stage"]["layer_end"] for m in coord.export.manifests]
            first = await gen()
            decision = await coord.async_rebalance()
            after = [m["stage"]["layer_end"] for m in coord.export.manifests]
            second = await gen()
            return before, first, decision, after, second, coord.calibration.get("smollm2-135m|int8")
        finally:
            await coord.async_stop()

    with LocalCluster(2) as c:
        before, first, decision, after, second, stored = aio.run(go(c.nodes))
    assert before == [29, 30]
    assert decision is not None and decision["replanned"], decision
    assert 12 <= after[0] <= 24, after  # the head measures ~7 layers on CPU: a near-even split
    assert stored is not None and 2.0 < stored < 30.0  # measured, well away from the stored 40 (~7 on a quiet CPU)
    assert second == first and len(first) == 40
    report(f"rebalance: split 29|1 -> {after[0]}|{30 - after[0]}, head measured as {stored:.1f} layers, same text")
