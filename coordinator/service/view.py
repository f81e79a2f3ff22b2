"""What ``lakeshard serve`` shows of its cluster: the agents of its plan, in stage order (the
elected coordinator shows the nodes it hears instead: :meth:`CoordinatorRole.cluster_view`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.protocol.cluster_view import ClusterView, NodeInfo

if TYPE_CHECKING:
    from coordinator.service.shared import Core


def served_by(c: Core) -> list[str]:
    """The nodes of the current plan, in stage order (ids where known, else addresses)."""
    return [c.node_ids.get(n, n) for n in c.nodes]


def standalone_view(c: Core) -> ClusterView:
    """A fixed pipeline's view (``lakeshard serve``): its agents, in stage order."""
    mans = [] if c.export is None else c.export.manifests
    ranges = [(m["stage"]["layer_start"], m["stage"]["layer_end"]) for m in mans]
    nodes, ring = [], []
    for i, addr in enumerate(c.nodes):
        node = addr.replace(":", "-").replace("[", "").replace("]", "")[:64]
        layers = tuple(ranges[i]) if i < len(ranges) else None
        nodes.append(NodeInfo(node, addr, addr, "standalone", "available", stage=i, layers=layers))
        ring.append(node)
    sched = c.scheduler
    return ClusterView(
        cluster=c.cfg.cluster_id,
        coordinator=None,
        term=c.term,
        model=c.cfg.model.name,
        service="serving" if c.pipeline is not None else "assigning",
        ring=tuple(ring),
        nodes=tuple(nodes),
        streams=sched.active if sched else 0,
        waiting=sched.waiting if sched else 0,
        preparing=c.prep.current,
    )
