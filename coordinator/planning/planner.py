"""Pipeline split planning: contiguous layer ranges that minimise the slowest stage.

Pure functions. A stage's decode cost is proportional to the weights it multiplies per token
(decoder layers, plus the lm_head on the last stage, which for a large vocabulary weighs as
much as several layers); the embedding lookup reads one row and costs next to nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from agent.cluster.offers import NodeOffer
from coordinator.planning.batch_cost import Curve, ring_token_s


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


def model_costs(config: Any, head_layers: float | None = None) -> ModelCosts:
    """Per-token cost of a decoder layer and of the lm_head; ``head_layers`` (measured, see
    ``coordinator.planning.calibration``) replaces the head's estimate when given."""
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
    head = head_layers * layer if head_layers is not None else float(h * config.vocab_size)
    return ModelCosts(n_layers=int(config.num_hidden_layers), layer=float(layer), head=float(head))


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


# ---- capacity-aware planning over real nodes --------------------------------------------------

GIB = 1024**3
HOME_SLACK = 0.02  # the coordinator's node goes first where that costs the bottleneck at most this
BYTES_PER_WEIGHT = {"fp32": 4.0, "fp16": 2.0, "int8": 1.06, "int4": 0.56}  # scales and zero points included


@dataclass(frozen=True)
class Footprint:
    """Memory a stage needs: weights of its layers (+ embeddings / lm_head), KV, runtime."""

    costs: ModelCosts
    layer_bytes: int
    head_bytes: int
    embed_bytes: int
    kv_bytes_per_layer: int  # all streams at the planned context length
    runtime_bytes: int = 700 * 1024**2  # an agent process with OpenVINO loaded
    kv_token_bytes: int = 0  # KV of one token in one layer (K and V)

    def weight_bytes(self, start: int, end: int) -> int:
        """The weights a stage of layers ``start:end`` loads (no KV, no runtime)."""
        n = self.costs.n_layers
        return (
            (end - start) * self.layer_bytes
            + (self.embed_bytes if start == 0 else 0)
            + (self.head_bytes if end == n else 0)
        )

    def stage_bytes(self, start: int, end: int) -> int:
        """Its weights, the KV of its layers and the runtime."""
        return self.weight_bytes(start, end) + (end - start) * self.kv_bytes_per_layer + self.runtime_bytes

    def total_bytes(self, stages: int = 1) -> int:
        n = self.costs.n_layers
        weights = n * (self.layer_bytes + self.kv_bytes_per_layer) + self.embed_bytes + self.head_bytes
        return weights + stages * self.runtime_bytes


KV_BYTES = 4  # per cached element: a CPU stage's KV cache is f32 (a GPU's f16 needs half)


def footprint(config: Any, weights: str, streams: int = 4, context: int = 4096, kv_bytes: int = KV_BYTES) -> Footprint:
    """``kv_bytes`` per cached element: what a stage on the CPU keeps (the larger case)."""
    costs = model_costs(config)
    bpw = BYTES_PER_WEIGHT[weights]
    h = int(config.hidden_size)
    hd = int(getattr(config, "head_dim", None) or h // int(config.num_attention_heads))
    kv = 2 * int(config.num_key_value_heads) * hd * context * streams * kv_bytes  # K and V
    layer_weights = costs.layer - 2 * h * h  # the per-layer remainder in model_costs is not weights
    embed = int(config.vocab_size) * h * 2  # gathered from an f16 table
    return Footprint(
        costs=costs,
        layer_bytes=int(layer_weights * bpw),
        head_bytes=int(costs.head * bpw),
        embed_bytes=embed,
        kv_bytes_per_layer=kv,
        kv_token_bytes=2 * int(config.num_key_value_heads) * hd * kv_bytes,
    )


@dataclass(frozen=True)
class StagePlan:
    node: str
    start: int
    end: int
    mem_bytes: int
    seconds: float  # predicted compute per token
    device: str = ""  # the device of the node's offer it runs on ("": the agent's own choice)


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]
    bottleneck_s: float
    cycle_s: float  # one token through every stage and hop

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.start, s.end) for s in self.stages]

    @property
    def nodes(self) -> list[str]:
        return [s.node for s in self.stages]


@dataclass(frozen=True)
class _Node:
    """One node as the planner sees it: its devices' offers, fastest first (ties: more memory)."""

    name: str
    devices: tuple[NodeOffer, ...]
    factor: float  # 0.5 when limited (counted at half speed)

    @property
    def speed(self) -> float:
        return self.devices[0].speed * self.factor

    @property
    def mem_free(self) -> int:
        return max(d.mem_free for d in self.devices)

    def fitting(self, need: int) -> NodeOffer | None:
        """The fastest device with ``need`` bytes free (None: none has)."""
        return next((d for d in self.devices if d.mem_free >= need), None)


def _nodes(offers: Sequence[NodeOffer]) -> list[_Node]:
    """The offers grouped by node, in the nodes' first-seen order."""
    by: dict[str, list[NodeOffer]] = {}
    for o in offers:
        by.setdefault(o.node, []).append(o)
    return [
        _Node(n, tuple(sorted(ds, key=lambda d: (-d.speed, -d.mem_free, d.device))), _factor(ds))
        for n, ds in by.items()
    ]


def _usable(offers: Sequence[NodeOffer]) -> list[_Node]:
    """The nodes a plan may use: not paused, with a speed and free memory."""
    return _nodes([o for o in offers if o.state != "paused" and o.speed > 0 and o.mem_free > 0])


def _factor(devices: Sequence[NodeOffer]) -> float:
    return 0.5 if any(d.state == "limited" for d in devices) else 1.0


def _split(fp: Footprint, order: Sequence[_Node]) -> Plan | None:
    """Best contiguous split over ``order`` (one stage each, on the fastest of its node's devices
    that holds it) within memory; None if it cannot fit."""
    n, k = fp.costs.n_layers, len(order)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    on: list[list[NodeOffer | None]] = [[None] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        node = order[s - 1]
        for e in range(s, n - (k - s) + 1):
            for b in range(s - 1, e):
                if best[s - 1][b] == inf:
                    continue
                d = node.fitting(fp.stage_bytes(b, e))
                if d is None:
                    continue
                t = max(best[s - 1][b], 2 * fp.costs.stage_cost(b, e) / (d.speed * node.factor * 1e9))
                if t < best[s][e] - 1e-15:
                    best[s][e], cut[s][e], on[s][e] = t, b, d
    if best[k][n] == inf:
        return None
    stages: list[StagePlan] = []
    e = n
    for s in range(k, 0, -1):
        b, d = cut[s][e], on[s][e]
        assert d is not None
        secs = 2 * fp.costs.stage_cost(b, e) / (d.speed * order[s - 1].factor * 1e9)
        stages.append(StagePlan(d.node, b, e, fp.stage_bytes(b, e), secs, d.device))
        e = b
    stages.reverse()
    return Plan(tuple(stages), best[k][n], sum(x.seconds for x in stages))


def plan_pipeline(
    fp: Footprint,
    offers: Sequence[NodeOffer],
    *,
    streams: int = 1,
    hop_s: float = 0.002,
    gain: float = 0.05,
    home: str | None = None,
    min_nodes: int = 1,
    batch_curve: Curve | None = None,
) -> Plan:
    """Contiguous layer ranges over some of ``offers`` that serve ``streams`` streams fastest.

    ``batch_curve``: how a paged stage's step time grows with its batch, as calibration
    measured it for this model (:mod:`coordinator.planning.batch_cost`); with it, ``streams``
    users are batched about ``streams / k`` to a micro-batch on ``k`` stages, which is how a
    batching ring runs. Without it, each stream steps on its own.

    Time per token of the whole cluster is ``max(bottleneck, cycle / streams)``, where the
    cycle adds ``hop_s`` per hop: one stream gains nothing from extra nodes, many streams do.
    More nodes are used only when they cut that time by more than ``gain`` (or when the model
    does not fit on fewer), and never fewer than ``min_nodes`` of them while as many are usable
    (an admin's choice to keep each laptop's share small). Raises PlanError saying what is
    missing when nothing fits.

    ``home`` is the coordinator's own node: of splits as fast (within ``HOME_SLACK``, about the
    noise of the nodes' speed probes), one that gives it the first stage, so that the
    coordinator's frames reach stage 0 without a network hop (a speculative round then
    crosses the network as often as a plain token round the ring).

    A node may offer several devices (one offer each: its CPU, its GPU); each node gets at
    most one stage, on one of them, named in ``StagePlan.device``: the fastest of its devices
    whose free memory holds that stage (of devices as fast, the one with more memory). So a
    discrete GPU too small for the stage a split would give its node leaves that stage to the
    node's CPU and the system's RAM, and the split is chosen knowing it. Two stages on two
    devices of one node are not planned: an agent hosts one stage, and on a laptop the
    integrated GPU and the CPU share one memory bus, so decoding, which is bound by memory
    bandwidth, gains little from splitting across them.
    """
    usable = _usable(offers)
    if not usable:
        raise PlanError("no node is available (all paused or unknown)")
    least = max(1, min(min_nodes, len(usable)))
    plan = _plan_over(fp, usable, streams=streams, hop_s=hop_s, gain=gain, home=home, least=least, curve=batch_curve)
    if plan is not None:
        return plan
    need = fp.total_bytes(1)
    offered = sum(x.mem_free for x in usable)  # a node's roomiest device: the CPU and an iGPU share one RAM
    raise PlanError(
        f"needs {need / GIB:.1f} GB, cluster offers {offered / GIB:.1f} GB over {len(usable)} node(s)"
        + ("" if offered < need else " but no contiguous split fits the nodes' memory")
    )


def _plan_over(
    fp: Footprint,
    nodes: Sequence[_Node],
    *,
    streams: int,
    hop_s: float,
    gain: float,
    home: str | None,
    least: int = 1,
    curve: Curve | None = None,
) -> Plan | None:
    """:func:`plan_pipeline` over ``nodes``; None when nothing fits."""
    usable = sorted(nodes, key=lambda o: (-o.speed, -o.mem_free, o.name != home, o.name))
    best: tuple[float, Plan] | None = None
    for k in range(min(least, fp.costs.n_layers), min(len(usable), fp.costs.n_layers) + 1):
        chosen = usable[:k]
        orders = (
            itertools.permutations(chosen)
            if k <= 5
            else iter([tuple(chosen), tuple(sorted(chosen, key=lambda o: o.name != home))])
        )
        found: Plan | None = None
        homed: Plan | None = None  # the best plan with the coordinator's node first
        tried: set[tuple[tuple[tuple[tuple[float, int], ...], float, bool], ...]] = set()
        for order in orders:
            sig = tuple((tuple((d.speed, d.mem_free) for d in o.devices), o.factor, o.name == home) for o in order)
            if sig in tried:  # nodes alike: the same split
                continue
            tried.add(sig)
            p = _split(fp, order)
            if p is None:
                continue
            if found is None or p.bottleneck_s < found.bottleneck_s - 1e-15:
                found = p
            if order[0].name == home and (homed is None or p.bottleneck_s < homed.bottleneck_s - 1e-15):
                homed = p
        if found is None:
            continue
        if homed is not None and homed.bottleneck_s <= found.bottleneck_s * (1 + HOME_SLACK):
            found = homed
        cycle = found.cycle_s + hop_s * k  # k hops: coordinator -> stages -> back
        score = token_s(found.stages, hop_s, streams, curve)
        if best is None or score < best[0] * (1 - gain):
            best = (score, Plan(found.stages, found.bottleneck_s, cycle))
    return None if best is None else best[1]


def token_s(stages: Sequence[StagePlan], hop_s: float, streams: int, curve: Curve | None) -> float:
    """Predicted seconds per token, all streams together, of ``stages`` with a hop each: per
    stream ``max(bottleneck, cycle / streams)``; batched, along ``curve``."""
    secs = [s.seconds for s in stages]
    if curve is not None:
        return ring_token_s(secs, hop_s, streams, curve)
    return max(max(secs), (sum(secs) + hop_s * len(secs)) / max(1, streams))


HELD_SLACK = 0.10  # a split already exported is kept when this close to the best one


def fixed_plan(
    fp: Footprint, offers: Sequence[NodeOffer], nodes: Sequence[str], ranges: Sequence[tuple[int, int]]
) -> Plan | None:
    """The plan that runs ``ranges`` on ``nodes`` (in order), each on the fastest of its node's
    devices that holds it; None when a node is unknown or cannot hold its stage."""
    by = {n.name: n for n in _nodes(offers)}
    stages = []
    for node, (b, e) in zip(nodes, ranges, strict=True):
        n = by.get(node)
        d = None if n is None else n.fitting(fp.stage_bytes(b, e))
        if n is None or d is None:
            return None
        secs = 2 * fp.costs.stage_cost(b, e) / (d.speed * n.factor * 1e9)
        stages.append(StagePlan(d.node, b, e, fp.stage_bytes(b, e), secs, d.device))
    return Plan(tuple(stages), max(x.seconds for x in stages), sum(x.seconds for x in stages))


def prefer_held(
    fp: Footprint,
    offers: Sequence[NodeOffer],
    plan: Plan,
    held: Sequence[Sequence[tuple[int, int]]],
    slack: float = HELD_SLACK,
    *,
    streams: int = 1,
    hop_s: float = 0.002,
    home: str | None = None,
    min_nodes: int = 1,
    batch_curve: Curve | None = None,
) -> Plan:
    """``plan``, or a split already exported (``held``: their layer ranges) when it serves within
        ``slack`` of the plan's time per token (``max(bottleneck, cycle / streams)``, as planned): an
        export costs minutes, a few per cent of speed costs less, and a cluster formed again on the
        same laptops then finds its export instead of making another that differs by a layer because
        the speed probes differed by a few per cent.

        A held split of ``k`` stages is tried on the plan's nodes (then the fastest others) in every
        order (``k`` <= 5), since the probes may have ranked alike nodes another way; of candidates as
        good (within ``HOME_SLACK``), one that starts on ``home``. Never fewer than ``min_nodes`` stages
    while as many nodes are usable (as :func:`plan_pipeline`)."""
    if any(list(r) == plan.ranges for r in held):
        return plan  # exported already
    usable = _usable(offers)
    others = [n.name for n in sorted(usable, key=lambda n: (-n.speed, n.name)) if n.name not in plan.nodes]
    pool = [*plan.nodes, *others]
    least = max(1, min(min_nodes, len(usable)))
    limit = token_s(plan.stages, hop_s, streams, batch_curve) * (1 + slack) + 1e-15
    found: list[tuple[float, Plan]] = []
    for ranges in held:
        k = len(ranges)
        if not least <= k <= len(pool):
            continue
        chosen = pool[:k]
        orders: Iterable[Sequence[str]] = itertools.permutations(chosen) if k <= 5 else [chosen]
        for order in orders:
            p = fixed_plan(fp, offers, order, ranges)
            if p is None:
                continue
            cycle = p.cycle_s + hop_s * k
            score = token_s(p.stages, hop_s, streams, batch_curve)
            if score <= limit:
                found.append((score, Plan(p.stages, p.bottleneck_s, cycle)))
    if not found:
        return plan
    best = min(found, key=lambda f: f[0])
    homed = [f for f in found if f[1].nodes[0] == home and f[0] <= best[0] * (1 + HOME_SLACK)]
    return min(homed, key=lambda f: f[0])[1] if homed else best[1]
