"""Pipeline split planning: contiguous layer ranges that minimise the slowest stage.

Pure functions. A stage's decode cost is proportional to the weights it multiplies per token
(decoder layers, plus the lm_head on the last stage, which for a large vocabulary weighs as
much as several layers); the embedding lookup reads one row and costs next to nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class ModelCosts:
    """Per-token cost (in multiply-accumulates) of the parts of a decoder-only model."""

    n_layers: int
    layer: float
    head: float
    embed: float = 0.0

    def stage_cost(self, start: int, end: int, n_layers: int | None = None) -> float:
        n = self.n_layers if n_layers is None else n_layers
        c = (end - start) * self.layer
        if start == 0:
            c += self.embed
        if end == n:
            c += self.head
        return c


def model_costs(config: Any) -> ModelCosts:
    h = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    hd = int(getattr(config, "head_dim", None) or h // heads)
    kv = int(config.num_key_value_heads)
    inter = int(config.intermediate_size)
    # Weights multiplied per token, plus a per-layer remainder (norms, RoPE, attention over
    # the cache, reorders) that measures at about 2*H^2 multiply-accumulates on CPU: with it,
    # the predicted lm_head/layer ratio matches measured stage times within a few percent
    # (Qwen2.5-0.5B: 8.2 layers predicted and measured; SmolLM2-135M: 6.7 vs 6.6).
    layer = h * (heads * hd) + 2 * h * (kv * hd) + (heads * hd) * h + 3 * h * inter + 2 * h * h
    return ModelCosts(n_layers=int(config.num_hidden_layers), layer=float(layer), head=float(h * config.vocab_size))


def balanced_split(costs: ModelCosts, n_stages: int, speeds: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """Split ``costs.n_layers`` layers into ``n_stages`` contiguous, non-empty ranges.

    Minimises the slowest stage's time, ``stage_cost / speed`` (speeds default to equal).
    Exact dynamic programme over cut points; ties go to the earlier cut.
    """
    n = costs.n_layers
    if n_stages < 1:
        raise PlanError("need at least one stage")
    if n_stages > n:
        raise PlanError(f"cannot split {n} layers into {n_stages} stages (at most one stage per layer)")
    sp = list(speeds) if speeds is not None else [1.0] * n_stages
    if len(sp) != n_stages or any(s <= 0 for s in sp):
        raise PlanError("need one positive speed per stage")
    inf = float("inf")
    # best[s][e]: minimal max time for layers [0, e) over the first s stages
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for e in range(s, n - (n_stages - s) + 1):
            for b in range(s - 1, e):
                if best[s - 1][b] == inf:
                    continue
                t = max(best[s - 1][b], costs.stage_cost(b, e) / sp[s - 1])
                if t < best[s][e] - 1e-9:
                    best[s][e], cut[s][e] = t, b
    ranges: list[tuple[int, int]] = []
    e = n
    for s in range(n_stages, 0, -1):
        b = cut[s][e]
        ranges.append((b, e))
        e = b
    return ranges[::-1]


def split_from_cuts(n_layers: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    """``--split 16,24`` -> [(0, 16), (16, 24), (24, n)]: each cut is where a stage starts."""
    pts = [0, *cuts, n_layers]
    if any(b <= a for a, b in pairwise(pts)):
        raise PlanError(f"split points must be increasing and inside 1..{n_layers - 1}, got {list(cuts)}")
    return list(pairwise(pts))
