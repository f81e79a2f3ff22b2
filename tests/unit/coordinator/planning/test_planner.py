"""The split planner: a pure function, tested table-driven."""

from __future__ import annotations

import pytest

from coordinator.planning.planner import (
    Footprint,
    ModelCosts,
    NodeOffer,
    PlanError,
    balanced_split,
    fixed_plan,
    footprint,
    plan_pipeline,
    prefer_held,
    split_from_cuts,
)


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


# ---- capacity-aware planning over heterogeneous nodes ---------------------------------------

MB = 1024**2
GB = 1024**3
# 10 layers of 100 MB; lm_head as heavy as 3 layers; small embeddings, KV and runtime
FP = Footprint(
    costs=ModelCosts(10, layer=5e8, head=1.5e9),
    layer_bytes=100 * MB,
    head_bytes=300 * MB,
    embed_bytes=50 * MB,
    kv_bytes_per_layer=10 * MB,
    runtime_bytes=100 * MB,
)
WHOLE = FP.total_bytes(1)  # about 1.5 GB


def _o(node: str, gb: float, speed: float = 100.0, state: str = "available") -> NodeOffer:
    return NodeOffer(node, int(gb * GB), speed, state)


@pytest.mark.parametrize(
    ("offers", "streams", "nodes", "ranges"),
    [
        # one stream, the model fits one node: no hops at all
        ([_o("a", 8), _o("b", 8), _o("c", 8)], 1, ["a"], [(0, 10)]),
        # one stream, but no node holds it all: as few nodes as it takes
        ([_o("a", 1), _o("b", 1), _o("c", 1)], 1, ["a", "b"], [(0, 6), (6, 10)]),
        # many streams: every node works, the lm_head's stage gets fewer layers
        ([_o("a", 8), _o("b", 8), _o("c", 8)], 8, ["a", "b", "c"], [(0, 4), (4, 8), (8, 10)]),
        # the slower node gets the smaller share (one layer plus the lm_head: 80 ms vs 90 ms)
        ([_o("slow", 8, 50.0), _o("fast", 8, 100.0)], 8, ["fast", "slow"], [(0, 9), (9, 10)]),
        # a fast node with 0.5 GB takes the one stage that fits it and pays most: the lm_head
        ([_o("fast", 0.5, 400.0), _o("big", 8, 100.0)], 8, ["big", "fast"], [(0, 9), (9, 10)]),
        # a paused node is never used; a limited one counts at half speed
        ([_o("p", 8, 500.0, "paused"), _o("a", 8)], 8, ["a"], [(0, 10)]),
        ([_o("lim", 8, 150.0, "limited"), _o("a", 8, 100.0)], 1, ["a"], [(0, 10)]),
    ],
)
def test_plan_pipeline(offers: list[NodeOffer], streams: int, nodes: list[str], ranges: list[tuple[int, int]]) -> None:
    plan = plan_pipeline(FP, offers, streams=streams, hop_s=0.001)
    assert plan.nodes == nodes
    assert plan.ranges == ranges
    by_node = {o.node: o for o in offers}
    assert all(s.mem_bytes <= by_node[s.node].mem_free for s in plan.stages)
    assert plan.ranges[0][0] == 0 and plan.ranges[-1][1] == 10


@pytest.mark.parametrize(
    ("offers", "streams", "home", "nodes", "ranges"),
    [
        # nodes alike: the coordinator's own node takes the first stage (its hop is local)
        ([_o("a", 8), _o("b", 8), _o("c", 8)], 8, "c", ["c", "a", "b"], [(0, 4), (4, 8), (8, 10)]),
        ([_o("a", 8), _o("b", 8)], 8, "b", ["b", "a"], [(0, 6), (6, 10)]),
        # speeds measured 1% apart are alike: probes differ by that much on twin laptops
        ([_o("a", 8, 101.0), _o("b", 8, 100.0)], 8, "b", ["b", "a"], [(0, 6), (6, 10)]),
        # one node is enough: of nodes alike, the coordinator's own
        ([_o("a", 8), _o("b", 8), _o("c", 8)], 1, "b", ["b"], [(0, 10)]),
        # a slower home node first, where that is as fast (90 ms a token either way)
        ([_o("slow", 8, 50.0), _o("fast", 8, 100.0)], 8, "slow", ["slow", "fast"], [(0, 4), (4, 10)]),
        # never at the cost of speed: the fast home node keeps the lm_head's stage
        ([_o("x", 8, 25.0), _o("y", 8, 25.0), _o("z", 8, 50.0)], 8, "z", ["x", "y", "z"], [(0, 3), (3, 6), (6, 10)]),
        # nor of memory: the 0.5 GB home node cannot hold stage 0's embeddings
        ([_o("fast", 0.5, 400.0), _o("big", 8, 100.0)], 8, "fast", ["big", "fast"], [(0, 9), (9, 10)]),
        # a coordinator that serves no stage changes nothing
        ([_o("a", 8), _o("b", 8)], 8, "elsewhere", ["a", "b"], [(0, 6), (6, 10)]),
    ],
)
def test_plan_puts_the_coordinators_node_first(
    offers: list[NodeOffer], streams: int, home: str, nodes: list[str], ranges: list[tuple[int, int]]
) -> None:
    plan = plan_pipeline(FP, offers, streams=streams, hop_s=0.001, home=home)
    assert plan.nodes == nodes
    assert plan.ranges == ranges


@pytest.mark.parametrize(
    ("offers", "streams", "min_nodes", "nodes"),
    [
        # one stream: one node is fastest, but the admin asked for the model spread over three
        ([_o("a", 8), _o("b", 8), _o("c", 8)], 1, 3, ["a", "b", "c"]),
        # two of them, where one would do
        ([_o("a", 8), _o("b", 8), _o("c", 8)], 1, 2, ["a", "b"]),
        # more than are available: all that are (a paused node does not count)
        ([_o("a", 8), _o("b", 8), _o("p", 8, state="paused")], 1, 3, ["a", "b"]),
        # a minimum below what speed already asks for changes nothing
        ([_o("a", 8), _o("b", 8), _o("c", 8)], 64, 2, ["a", "b", "c"]),
    ],
)
def test_plan_spreads_over_at_least_min_nodes(
    offers: list[NodeOffer], streams: int, min_nodes: int, nodes: list[str]
) -> None:
    plan = plan_pipeline(FP, offers, streams=streams, hop_s=0.001, min_nodes=min_nodes)
    assert sorted(plan.nodes) == nodes
    assert plan.ranges[0][0] == 0 and plan.ranges[-1][1] == 10
    assert all(a[1] == b[0] for a, b in zip(plan.ranges, plan.ranges[1:], strict=False))


def test_plan_declines_and_says_what_is_missing() -> None:
    with pytest.raises(PlanError, match=r"needs 1\.5 GB, cluster offers 0\.8 GB over 2 node\(s\)"):
        plan_pipeline(FP, [_o("a", 0.4), _o("b", 0.4), _o("p", 64, state="paused")])
    with pytest.raises(PlanError, match="no node is available"):
        plan_pipeline(FP, [_o("p", 64, state="paused")])


def test_footprint_of_a_real_config() -> None:
    from tests.support.configs import QWEN05

    fp = footprint(QWEN05, "int4", streams=1, context=1024)
    weights = 24 * fp.layer_bytes + fp.head_bytes
    assert 200 * MB < weights < 400 * MB  # Qwen2.5-0.5B at INT4: about 0.3 GB of weights
    assert fp.head_bytes > 5 * fp.layer_bytes  # its lm_head weighs as much as several layers
    # a 1024-token stream's KV at the CPU's f32: 24 MB (bench memory measured 24.7-25.2 MB a stream)
    assert 23 * MB < 24 * fp.kv_bytes_per_layer < 25 * MB


# ---- one offer per device: the planner picks each node's device ------------------------------


def _d(node: str, device: str, gb: float, speed: float, state: str = "available") -> NodeOffer:
    return NodeOffer(node, int(gb * GB), speed, state, device)


@pytest.mark.parametrize(
    ("offers", "streams", "home", "stages"),
    [
        # a GPU 3x as fast as its node's CPU takes the node's stage
        ([_d("a", "CPU", 8, 100.0), _d("a", "GPU", 8, 300.0)], 1, None, [("a", "GPU", 0, 10)]),
        # the model (1.5 GB) does not fit the discrete GPU's 1 GB: the node's CPU, with the system's RAM
        ([_d("a", "CPU", 8, 100.0), _d("a", "GPU.1", 1, 300.0)], 1, None, [("a", "CPU", 0, 10)]),
        # devices as fast: the one with more free memory
        ([_d("a", "CPU", 8, 100.0), _d("a", "GPU.1", 16, 100.0)], 1, None, [("a", "GPU.1", 0, 10)]),
        # two nodes, one with a GPU: the GPU node takes the larger share (and the lm_head)
        (
            [_d("a", "CPU", 8, 100.0), _d("a", "GPU", 8, 300.0), _d("b", "CPU", 8, 100.0)],
            8,
            None,
            [("b", "CPU", 0, 3), ("a", "GPU", 3, 10)],
        ),
        # the coordinator's node first changes nothing here: it was first anyway
        (
            [_d("b", "CPU", 8, 100.0), _d("a", "CPU", 8, 100.0), _d("a", "GPU", 8, 300.0)],
            8,
            "b",
            [("b", "CPU", 0, 3), ("a", "GPU", 3, 10)],
        ),
        # a small discrete GPU still takes a stage that fits it, when a plan over fastest devices fits
        (
            [_d("a", "CPU", 8, 100.0), _d("a", "GPU.1", 1, 300.0), _d("b", "CPU", 8, 100.0)],
            8,
            None,
            [("b", "CPU", 0, 5), ("a", "GPU.1", 5, 10)],
        ),
        # nothing fits over the fastest devices: every node's roomiest device
        (
            [_d("a", "CPU", 1, 100.0), _d("a", "GPU.1", 0.5, 300.0), _d("b", "CPU", 1, 100.0)],
            1,
            None,
            [("a", "CPU", 0, 6), ("b", "CPU", 6, 10)],
        ),
        # a fast GPU that holds only the lm_head's stage would leave the slow node 9 layers (180 ms):
        # the node's CPU alone is faster (130 ms), and its GPU is left idle
        (
            [_d("a", "CPU", 8, 100.0), _d("a", "GPU.1", 0.5, 400.0), _d("b", "CPU", 8, 50.0)],
            1,
            None,
            [("a", "CPU", 0, 10)],
        ),
        # as with many streams: two CPUs at 70 ms a token beat that GPU's stage and a CPU with 9 layers (90 ms)
        (
            [_d("a", "CPU", 8, 100.0), _d("a", "GPU.1", 0.5, 400.0), _d("b", "CPU", 8, 100.0)],
            8,
            None,
            [("a", "CPU", 0, 6), ("b", "CPU", 6, 10)],
        ),
        # a limited node counts at half speed on every device: its GPU is no faster than the other node's CPU
        (
            [_d("a", "CPU", 8, 100.0, "limited"), _d("a", "GPU", 8, 200.0, "limited"), _d("b", "CPU", 8, 150.0)],
            1,
            None,
            [("b", "CPU", 0, 10)],
        ),
        # a paused node's devices are all left out
        (
            [_d("p", "GPU", 8, 900.0, "paused"), _d("p", "CPU", 8, 100.0, "paused"), _d("a", "CPU", 8, 100.0)],
            8,
            None,
            [("a", "CPU", 0, 10)],
        ),
        # offers from agents that do not say per device: the stage's device is left to the agent
        ([_o("a", 8), _o("b", 8)], 8, None, [("a", "", 0, 6), ("b", "", 6, 10)]),
    ],
)
def test_plan_picks_each_nodes_device(
    offers: list[NodeOffer], streams: int, home: str | None, stages: list[tuple[str, str, int, int]]
) -> None:
    plan = plan_pipeline(FP, offers, streams=streams, hop_s=0.001, home=home)
    assert [(s.node, s.device, s.start, s.end) for s in plan.stages] == stages
    assert len(set(plan.nodes)) == len(plan.nodes)  # one stage per node at most
    by_device = {(o.node, o.device): o for o in offers}
    assert all(s.mem_bytes <= by_device[s.node, s.device].mem_free for s in plan.stages)


def test_plan_over_devices_says_what_is_missing() -> None:
    # the shared memory of a node's CPU and integrated GPU is counted once
    with pytest.raises(PlanError, match=r"needs 1\.5 GB, cluster offers 0\.8 GB over 2 node\(s\)"):
        plan_pipeline(FP, [_d("a", "CPU", 0.4, 100.0), _d("a", "GPU", 0.4, 300.0), _d("b", "CPU", 0.4, 100.0)])


# ---- an export at hand beats a marginally faster split ------------------------------------------

THREE = [_o("a", 8), _o("b", 8), _o("c", 8)]  # best for 8 streams: (0, 4), (4, 8), (8, 10)


@pytest.mark.parametrize(
    ("held", "ranges"),
    [
        # another split as fast as the best (the first stage was never the slowest): kept, no export
        ([[(0, 5), (5, 8), (8, 10)]], [(0, 5), (5, 8), (8, 10)]),
        # of two held, the one within 10% (a layer off here is 20% slower: exported anew)
        ([[(0, 3), (3, 7), (7, 10)], [(0, 4), (4, 9), (9, 10)]], [(0, 4), (4, 9), (9, 10)]),
        ([[(0, 3), (3, 7), (7, 10)]], [(0, 4), (4, 8), (8, 10)]),
        # the best split itself is held: nothing changes
        ([[(0, 4), (4, 8), (8, 10)], [(0, 3), (3, 7), (7, 10)]], [(0, 4), (4, 8), (8, 10)]),
        # much slower (the last stage with the lm_head and 5 layers): exported anew
        ([[(0, 2), (2, 5), (5, 10)]], [(0, 4), (4, 8), (8, 10)]),
        # two stages: for 8 streams about twice as slow: exported anew
        ([[(0, 5), (5, 10)]], [(0, 4), (4, 8), (8, 10)]),
        # nothing held
        ([], [(0, 4), (4, 8), (8, 10)]),
    ],
)
def test_a_held_split_is_kept_when_about_as_fast(
    held: list[list[tuple[int, int]]], ranges: list[tuple[int, int]]
) -> None:
    plan = plan_pipeline(FP, THREE, streams=8, hop_s=0.001)
    got = prefer_held(FP, THREE, plan, held, streams=8, hop_s=0.001)
    assert got.ranges == ranges
    assert got.nodes == plan.nodes
    assert got.bottleneck_s <= plan.bottleneck_s * 1.1


@pytest.mark.parametrize(
    ("offers", "streams", "min_nodes", "held", "nodes", "ranges"),
    [
        # the probes ranked b fastest this time: the held split fits best with its long middle on b
        # (on the plan's order, b first, it would be 50% slower and exported anew)
        (
            [_o("a", 8, 100), _o("b", 8, 160), _o("c", 8, 100)],
            8,
            1,
            [[(0, 3), (3, 9), (9, 10)]],
            ["a", "b", "c"],
            [(0, 3), (3, 9), (9, 10)],
        ),
        # one stream plans one node; two stages held cost one hop more (1%): kept, nothing exported
        (THREE, 1, 1, [[(0, 5), (5, 10)]], ["a", "b"], [(0, 5), (5, 10)]),
        # ... but not below the admin's least number of nodes: the plan stands
        (THREE, 1, 3, [[(0, 5), (5, 10)]], ["a", "b", "c"], [(0, 4), (4, 8), (8, 10)]),
        # two streams plan two nodes; three stages held are faster still: taken
        (THREE, 2, 1, [[(0, 4), (4, 8), (8, 10)]], ["a", "b", "c"], [(0, 4), (4, 8), (8, 10)]),
        # a held split needing more nodes than there are: the plan stands
        ([_o("a", 8), _o("b", 8)], 2, 1, [[(0, 4), (4, 8), (8, 10)]], ["a", "b"], [(0, 6), (6, 10)]),
    ],
)
def test_a_held_split_is_tried_in_every_order_and_stage_count(
    offers: list[NodeOffer],
    streams: int,
    min_nodes: int,
    held: list[list[tuple[int, int]]],
    nodes: list[str],
    ranges: list[tuple[int, int]],
) -> None:
    plan = plan_pipeline(FP, offers, streams=streams, hop_s=0.001, min_nodes=min_nodes)
    got = prefer_held(FP, offers, plan, held, streams=streams, hop_s=0.001, min_nodes=min_nodes)
    assert (got.nodes, got.ranges) == (nodes, ranges)
    per_token = max(plan.bottleneck_s, plan.cycle_s / streams)
    assert max(got.bottleneck_s, got.cycle_s / streams) <= per_token * 1.1


def test_a_held_split_starts_on_the_coordinators_node_when_as_good() -> None:
    # a, b, c alike: every order of the held split is as fast; the coordinator's node (c) goes first
    plan = plan_pipeline(FP, THREE, streams=8, hop_s=0.001, home="c")
    got = prefer_held(FP, THREE, plan, [[(0, 5), (5, 8), (8, 10)]], streams=8, hop_s=0.001, home="c")
    assert got.ranges == [(0, 5), (5, 8), (8, 10)] and got.nodes[0] == "c"


def test_a_held_split_that_a_node_cannot_hold_is_not_taken() -> None:
    small = [_o("a", 8), _o("b", 0.45), _o("c", 8)]  # b holds 3 layers, not 4
    plan = plan_pipeline(FP, small, streams=8, hop_s=0.001)
    bigger_middle = [(r[0], r[1]) for r in plan.ranges]
    i = plan.nodes.index("b")
    if i + 1 < len(bigger_middle):
        a, b = bigger_middle[i]
        bigger_middle[i], bigger_middle[i + 1] = (a, b + 1), (b + 1, bigger_middle[i + 1][1])
    assert bigger_middle != plan.ranges  # (b's stage one layer longer: more than b holds)
    assert fixed_plan(FP, small, plan.nodes, bigger_middle) is None
    assert prefer_held(FP, small, plan, [bigger_middle], streams=8, hop_s=0.001).ranges == plan.ranges


# ---- batching rings: the measured batch curve decides how many nodes pay ---------------------

FLAT = ((1, 1.0), (4, 1.1), (8, 1.2), (16, 1.5))  # a memory-bound device: rows nearly free
STEEP = ((1, 1.0), (4, 3.8), (8, 7.5), (16, 15.0))  # compute-bound: a row costs almost a step


@pytest.mark.parametrize(
    ("curve", "users", "nodes"),
    [
        (None, 8, 3),  # per stream: many streams keep every node busy
        (FLAT, 8, 1),  # one node batching 8 users does it all; hops would only add
        (FLAT, 1, 1),
        (STEEP, 8, 3),  # batching saves little: the work is spread
        (STEEP, 16, 3),
        (STEEP, 1, 1),  # one user gains nothing from more nodes
    ],
)
def test_the_batch_curve_decides_how_many_nodes_pay(
    curve: tuple[tuple[int, float], ...] | None, users: int, nodes: int
) -> None:
    offers = [_o("a", 8), _o("b", 8), _o("c", 8)]
    plan = plan_pipeline(FP, offers, streams=users, hop_s=0.001, batch_curve=curve)
    assert len(plan.nodes) == nodes
    # a split already exported is judged on the same model
    held = prefer_held(FP, offers, plan, [[(0, 5), (5, 10)]], streams=users, hop_s=0.001, batch_curve=curve)
    assert held.ranges in (plan.ranges, [(0, 5), (5, 10)])
