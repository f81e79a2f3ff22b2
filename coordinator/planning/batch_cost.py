"""What a stage step costs as its batch grows, and what that makes of a ring's speed (pure).

A paged stage computes many streams' rows in one infer call: the weights are read once a
step, so a step of B rows costs far less than B one-row steps (on a memory-bound iGPU even
more so). How much less is measured, not assumed: each paged stage reports its median step
time per batch size (``step_ms_by_rows``), :func:`fit_curve` turns that into a curve
``g(B) = t(B) / t(1)`` and the calibration store keeps it per model and weights. Until a
ring has measured one, the planner keeps its per-stream model (each stream its own steps).

With U users on k stages, the coordinator keeps about k micro-batches of U/k streams in
flight. A round gives every user one token; it lasts as long as the busiest stage needs for
its k micro-batches, or as one micro-batch's trip round the ring, whichever is longer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import pairwise

Curve = tuple[tuple[int, float], ...]  # (rows, t(rows) / t(1)), rows ascending, first (1, 1.0)
MIN_POINTS = 2  # batch sizes a fit needs besides 1
MAX_ROWS = 4096


def step_scale(curve: Curve, rows: float) -> float:
    """``g(rows)``: a step of ``rows`` rows against a step of one, read off ``curve``
    (log-log interpolation between its points; past the last, each row costs what a row
    of the last segment did)."""
    if rows <= 1 or len(curve) < 2:
        return max(1.0, rows) if len(curve) < 2 else 1.0
    for (b0, g0), (b1, g1) in pairwise(curve):
        if rows <= b1:
            f = (math.log(rows) - math.log(b0)) / (math.log(b1) - math.log(b0))
            return math.exp(math.log(g0) + f * (math.log(g1) - math.log(g0)))
    (b0, g0), (b1, g1) = curve[-2], curve[-1]
    slope = max(0.0, (g1 - g0) / (b1 - b0))
    return g1 + slope * (rows - b1)


def fit_curve(stages: Sequence[Mapping[int, float]]) -> Curve | None:
    """The curve from each stage's median step time per batch size (ms); None when no stage
    has timed one-row steps and at least ``MIN_POINTS`` larger sizes. Each stage is scaled
    by its own one-row time; stages are averaged per size; the curve is made monotone
    (a larger batch never costs less than a smaller one)."""
    ratios: dict[int, list[float]] = {}
    for st in stages:
        t1 = st.get(1)
        if not t1 or t1 <= 0:
            continue
        for b, t in st.items():
            if 1 < b <= MAX_ROWS and t > 0:
                ratios.setdefault(b, []).append(t / t1)
    if len(ratios) < MIN_POINTS:
        return None
    out: list[tuple[int, float]] = [(1, 1.0)]
    for b in sorted(ratios):
        g = max(out[-1][1], sum(ratios[b]) / len(ratios[b]))
        out.append((b, round(g, 4)))
    return tuple(out)


def ring_token_s(stage_s: Sequence[float], hop_s: float, users: int, curve: Curve) -> float:
    """Seconds per token, all users together, of a batching ring whose stages take
    ``stage_s`` for a one-row step and whose hops take ``hop_s`` each."""
    k, u = len(stage_s), max(1, users)
    g = step_scale(curve, u / k if u >= k else 1.0)
    micro = min(k, u)  # micro-batches in flight
    busiest = micro * max(stage_s) * g
    trip = sum(stage_s) * g + hop_s * k
    return max(busiest, trip) / u
