"""How many tokens of context a plan holds, from its nodes' offers (the KV pool rule)."""

from __future__ import annotations

from agent.cluster.offers import NodeOffer
from agent.runtime.kv_budget import KV_MOST, MIB, kv_pool_bytes
from coordinator.planning.context import cluster_context, plan_context
from coordinator.planning.planner import Plan, StagePlan, footprint
from tests.support.configs import QWEN05

GIB = 1 << 30
FP = footprint(QWEN05, "int4")


def _plan(*stages: tuple[str, int, int]) -> Plan:
    return Plan(tuple(StagePlan(n, a, b, 0, 0.0) for n, a, b in stages), 0.0, 0.0)


def test_a_roomy_node_holds_the_pool_ceiling_in_tokens() -> None:
    (one,) = plan_context(FP, _plan(("a", 0, 24)), [NodeOffer("a", 16 * GIB, 10.0)])
    assert FP.kv_token_bytes == 2 * 2 * 64 * 4  # K and V, 2 heads of 64, f32
    assert one.pool_bytes == KV_MOST and one.tokens == KV_MOST // (24 * 1024) == 43690


def test_the_most_crowded_stage_bounds_the_cluster() -> None:
    plan = _plan(("a", 0, 12), ("b", 12, 24))
    offers = [NodeOffer("a", 16 * GIB, 10.0), NodeOffer("b", 2 * GIB, 10.0)]
    a, b = plan_context(FP, plan, offers)
    assert b.pool_bytes == kv_pool_bytes(2 * GIB, FP.weight_bytes(12, 24) + FP.runtime_bytes) < a.pool_bytes
    assert 200 * MIB < b.pool_bytes < 300 * MIB  # a quarter of what its weights and runtime leave
    assert a.tokens == KV_MOST // (12 * 1024)
    assert cluster_context((a, b)) == b.tokens < a.tokens


def test_a_stage_on_its_gpu_counts_that_devices_memory() -> None:
    plan = Plan((StagePlan("a", 0, 24, 0, 0.0, device="GPU"),), 0.0, 0.0)
    offers = [NodeOffer("a", 16 * GIB, 10.0, device="CPU"), NodeOffer("a", 1 * GIB, 50.0, device="GPU")]
    (one,) = plan_context(FP, plan, offers)
    assert one.pool_bytes == kv_pool_bytes(1 * GIB, FP.weight_bytes(0, 24) + FP.runtime_bytes)


def test_a_node_without_an_offer_is_not_counted() -> None:
    ctx = plan_context(FP, _plan(("a", 0, 12), ("gone", 12, 24)), [NodeOffer("a", 16 * GIB, 10.0)])
    assert ctx[1].tokens == 0 and cluster_context(ctx) == ctx[0].tokens
    assert cluster_context(()) == 0
