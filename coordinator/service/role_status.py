"""What the elected coordinator tells of itself: its status (``/v1/cluster/status`` and the
daemon's ``/v1/node``), why its API cannot answer yet, and the cluster as node maps show it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from agent.protocol.cluster_view import ClusterView, NodeInfo
from coordinator.api.limits import Limits
from coordinator.batching.batcher import Batcher
from coordinator.planning.context import StageContext, cluster_context
from coordinator.planning.planner import Plan
from coordinator.service.coordinator import Coordinator
from coordinator.service.preparing import Preparer


class Seen(Protocol):
    """The role as its status sees it (:class:`coordinator.service.role.CoordinatorRole`)."""

    model_ref: str | None
    name: str | None
    term: int
    cluster: str
    state: str
    error: str | None
    plan: Plan | None
    context: tuple[StageContext, ...]  # per stage of the plan (empty: not foretold)
    addresses: dict[str, str]  # node id -> agent address
    coordinator: Coordinator | None
    api_limits: Limits
    adopted: dict[str, Any] | None
    prep: Preparer
    nodes: Callable[[], list[NodeInfo]]

    def api_base(self) -> str | None: ...

    def needed_exports(self) -> list[str]: ...


def not_ready(role: Seen) -> str | None:
    """Why the API cannot answer yet (None once it can)."""
    if role.api_base() is not None:
        return None
    if role.state == "no model":
        who = f"the coordinator {role.name}" if role.name else "the coordinator"
        return f"{who} serves no model: choose the cluster's model in Settings (or `lakeshard cluster model NAME`)"
    if role.state == "failed":
        return f"the coordinator could not form the pipeline: {role.error}"
    p = role.prep.current
    if p is not None and p.step not in ("ready", "failed"):
        return f"the coordinator is preparing {p.model}: {p.describe()}"
    return f"the coordinator is still forming the pipeline ({role.state})"


def _stages(role: Seen) -> dict[str, tuple[int, tuple[int, int]]]:
    """Node id -> its stage and layers: what runs now (after a failover too), else the plan."""
    c = role.coordinator
    if c is not None and c.export is not None and c.pipeline is not None:
        # what runs now (after a failover too): the coordinator's agents and their export
        ranges = [(m["stage"]["layer_start"], m["stage"]["layer_end"]) for m in c.export.manifests]
        ids = {a: n for n, a in role.addresses.items()}
        return {ids.get(addr, addr): (i, r) for i, (addr, r) in enumerate(zip(c.nodes, ranges, strict=False))}
    if role.plan is not None:
        return {st.node: (i, (st.start, st.end)) for i, st in enumerate(role.plan.stages)}
    return {}


def cluster_view(role: Seen) -> ClusterView:
    """The cluster as node maps show it: the nodes heard, the plan, the service, the load."""
    c = role.coordinator
    where = _stages(role)
    ring = [n for n, _ in sorted(where.items(), key=lambda kv: kv[1][0])]
    nodes = []
    heard = role.nodes()
    me = heard[0].node if heard else None  # this node (the daemon lists itself first)
    for n in heard:
        stage, layers = where.get(n.node, (None, None))
        nodes.append(replace(n, stage=stage, layers=layers))
    sched = c.scheduler if c is not None else None
    return ClusterView(
        cluster=role.cluster,
        coordinator=me,
        term=role.term,
        model=role.model_ref,
        service=role.state,
        error=role.error,
        ring=tuple(ring),
        nodes=tuple(sorted(nodes, key=lambda n: n.node)),
        streams=sched.active if sched else 0,
        waiting=sched.waiting if sched else 0,
        preparing=role.prep.current,
    )


def status(role: Seen) -> dict[str, Any]:
    c = role.coordinator
    stages = []
    if role.plan is not None:
        kv = {k.node: k for k in role.context}
        for s in role.plan.stages:
            k = kv.get(s.node)
            stages.append(
                {
                    "node": s.node,
                    "address": role.addresses.get(s.node),
                    "layers": [s.start, s.end],
                    "device": s.device or None,
                    "kv_pool_mb": round(k.pool_bytes / 2**20) if k else None,
                    "kv_tokens": k.tokens if k else None,
                }
            )
    return {
        "state": role.state,
        "model": role.model_ref,
        "term": role.term,
        "plan": stages,
        "context_tokens": cluster_context(role.context) or None,  # all users together, as planned
        "api": f"{c.api_url}/v1" if c is not None and c.api_url else None,
        "ring_port": c.ring_port if c is not None and c.ring_port else None,  # for firewalls
        "api_limits": role.api_limits.describe(),
        "recoveries": list(c.recoveries) if c is not None else [],
        "replans": list(c.replans) if c is not None else [],
        "speculation": _speculation(c),
        "batching": c.scheduler.summary() if c is not None and isinstance(c.scheduler, Batcher) else None,
        "adopted": role.adopted,
        "needed_exports": role.needed_exports(),
        "exported": c.exported if c is not None else 0,
        "preparing": _preparing(role.prep),
        "error": role.error,
    }


def _speculation(c: Coordinator | None) -> dict[str, Any] | None:
    """Every answer's speculation so far (None: this coordinator has no draft)."""
    sched = c.scheduler if c is not None else None
    if isinstance(sched, Batcher):
        return sched.drafter.counters.summary() if sched.drafter is not None else None
    spec = sched.speculator if sched is not None else None
    if spec is None:
        return None
    return {**spec.counters.summary(), "declined": spec.counters.declined}


def _preparing(prep: Preparer) -> str | None:
    """The preparation under way, in words (None: none, or it is over)."""
    p = prep.current
    return p.describe() if p is not None and p.step not in ("ready", "failed") else None
