"""Split costs learnt from measured stage times, so the next plan balances the real hardware.

The planner's cost model counts multiply-accumulates. How much the lm_head weighs against a
decoder layer depends on the device, precision and thread count (on a 4-core Xeon slice in
f32 the Qwen2.5-0.5B head costs about 6 layers, not the 8 its weights suggest), and the
slowest stage sets a pipeline's pace. So the coordinator reads each stage's median step time,
fits ``t = a * layers + b * [holds the head]`` and keeps ``b / a`` (the head in layers) per
model and weights, in the state folder.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from agent.common.paths import state_dir, write_json_atomic
from agent.protocol import ProtocolError
from agent.protocol.status import NodeStatus, StageStatus
from coordinator.planning.batch_cost import Curve

log = logging.getLogger(__name__)
HEAD_LIMITS = (0.25, 64.0)  # a fit outside this says the measurement was noise
MIN_FRAMES = 32  # steps a stage must have timed before its median counts


@dataclass(frozen=True)
class StageTime:
    start: int
    end: int
    last: bool
    step_ms: float

    @property
    def layers(self) -> int:
        return self.end - self.start


def fit_head_layers(stages: Sequence[StageTime]) -> float | None:
    """The head's cost in decoder layers, from stage step times; None when it cannot be told.

    The per-layer time comes from the stages without the head (their total time over their
    total layers), the head's from what the last stage takes beyond its layers.
    """
    body = [s for s in stages if not s.last]
    last = [s for s in stages if s.last]
    if not body or len(last) != 1 or any(s.step_ms <= 0 for s in stages):
        return None
    n = sum(s.layers for s in body)
    if n <= 0:
        return None
    per_layer = sum(s.step_ms for s in body) / n
    head = (last[0].step_ms - per_layer * last[0].layers) / per_layer
    if not HEAD_LIMITS[0] <= head <= HEAD_LIMITS[1]:
        return None
    return head


def bottleneck_ms(ranges: Sequence[tuple[int, int]], per_layer_ms: float, head_layers: float) -> float:
    """The slowest stage's predicted step time for ``ranges`` (the last holds the head)."""
    costs = [(e - s) + (head_layers if i == len(ranges) - 1 else 0.0) for i, (s, e) in enumerate(ranges)]
    return max(costs) * per_layer_ms


class CalibrationStore:
    """``{key: head_layers}`` and ``{key|batch: [[rows, g], ...]}`` (the batch curve, see
    :mod:`coordinator.planning.batch_cost`) in ``calibration.json`` of the state folder; a bad
    file or entry is ignored."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or state_dir() / "calibration.json"

    def _raw(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, data: dict[str, Any]) -> None:
        try:
            write_json_atomic(self.path, data, indent=1, sort_keys=True)
        except OSError as e:
            log.warning("cannot save the split calibration: %s", e)

    def get(self, key: str) -> float | None:
        v = self._raw().get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    def update(self, key: str, head_layers: float) -> None:
        """Keep the latest fit (a median over many steps; the hardware may have changed)."""
        data = self._raw()
        data[key] = round(head_layers, 4)
        self._write(data)

    def curve(self, key: str) -> Curve | None:
        """The batch curve measured for ``key`` (None: none yet, or unreadable)."""
        v = self._raw().get(f"{key}|batch")
        if not isinstance(v, list):
            return None
        try:
            pts = tuple((int(b), float(g)) for b, g in v)
        except (TypeError, ValueError):
            return None
        ok = len(pts) >= 2 and pts[0] == (1, 1.0) and all(b0 < b1 and g0 <= g1 for (b0, g0), (b1, g1) in pairwise(pts))
        return pts if ok else None

    def update_curve(self, key: str, curve: Curve) -> None:
        data = self._raw()
        data[f"{key}|batch"] = [list(p) for p in curve]
        self._write(data)


def calib_key(model: str, weights: str) -> str:
    """Under which key the measurements of ``model`` at ``weights`` are stored."""
    return f"{model}|{weights}"


def _stage_status(status: Any) -> StageStatus | None:
    """The stage part of an agent's ``/v1/node``: a daemon's
    (:class:`~agent.protocol.status.NodeStatus`, its ``stage``) or a bare stage agent's (the
    :class:`~agent.protocol.status.StageStatus` itself); None when it is unreadable."""
    try:
        daemon = isinstance(status, dict) and "node" in status
        return NodeStatus.parse(status).stage if daemon else StageStatus.parse(status)
    except ProtocolError as e:
        log.debug("calibration: an unreadable stage status: %s", e)
        return None


def stage_rows_ms(status: Any) -> dict[int, float] | None:
    """A paged stage's median step time by batch size, from an agent's ``/v1/node`` (None:
    a stateful stage, none measured yet, or an unreadable answer)."""
    st = _stage_status(status)
    if st is None:
        return None
    return st.step_ms_by_rows or None


@dataclass(frozen=True)
class Proposal:
    head_layers: float
    ranges: list[tuple[int, int]]
    current_ms: float  # the slowest stage now (measured)
    predicted_ms: float  # the slowest stage of ``ranges`` (from the fit)

    def pays(self, min_gain: float) -> bool:
        return self.predicted_ms < self.current_ms * (1.0 - min_gain)


def propose(
    stages: Sequence[StageTime], head_layers: float, plan: Callable[[float], list[tuple[int, int]]]
) -> Proposal:
    """The split ``plan(head_layers)`` would give, and its predicted bottleneck against now's."""
    body = [s for s in stages if not s.last]
    per_layer = sum(s.step_ms for s in body) / max(1, sum(s.layers for s in body))
    ranges = plan(head_layers)
    current = [(s.start, s.end) for s in stages]
    predicted = bottleneck_ms(ranges, per_layer, head_layers) if ranges != current else max(s.step_ms for s in stages)
    return Proposal(head_layers, ranges, max(s.step_ms for s in stages), predicted)


def stage_time(status: Any) -> StageTime | None:
    """A stage's layers and median step from an agent's ``/v1/node`` (:func:`_stage_status`).
    None while it has measured too few steps, serves nothing, or answers something unreadable
    (it is asked again later)."""
    st = _stage_status(status)
    if st is None:
        return None
    if st.frames < MIN_FRAMES or st.layers is None or st.stage is None or st.stages is None or st.step_ms_p50 is None:
        return None
    return StageTime(st.layers[0], st.layers[1], st.stage == st.stages - 1, st.step_ms_p50)
