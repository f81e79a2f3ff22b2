"""How many tokens of context a plan holds: each paged stage's KV pool, foretold from its offer.

A paged stage gives its KV blocks a share of the memory its node has free once the stage's
weights are in (:func:`agent.runtime.kv_budget.kv_pool_bytes`, the rule the agent applies when
it compiles the stage). Every stream's tokens are held on every stage, so the cluster holds as
many tokens of context, all users together, as its most crowded stage's pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.cluster.offers import NodeOffer
from agent.runtime.kv_budget import context_tokens, kv_pool_bytes
from coordinator.planning.planner import Footprint, Plan


@dataclass(frozen=True)
class StageContext:
    node: str
    pool_bytes: int
    tokens: int


def _offer(st_node: str, device: str, offers: Sequence[NodeOffer]) -> NodeOffer | None:
    mine = [o for o in offers if o.node == st_node]
    return next((o for o in mine if o.device == device), None) or max(mine, key=lambda o: o.mem_free, default=None)


def plan_context(fp: Footprint, plan: Plan, offers: Sequence[NodeOffer]) -> tuple[StageContext, ...]:
    """Each stage's foretold pool and the tokens it holds (0 where its node's offer is unknown)."""
    out = []
    for st in plan.stages:
        o = _offer(st.node, st.device, offers)
        if o is None:
            out.append(StageContext(st.node, 0, 0))
            continue
        pool = kv_pool_bytes(o.mem_free, fp.weight_bytes(st.start, st.end) + fp.runtime_bytes)
        out.append(StageContext(st.node, pool, context_tokens(pool, (st.end - st.start) * fp.kv_token_bytes)))
    return tuple(out)


def cluster_context(stages: Sequence[StageContext]) -> int:
    """Tokens of context the whole ring holds (its smallest stage's); 0 when none is known."""
    known = [s.tokens for s in stages if s.tokens > 0]
    return min(known) if known else 0
