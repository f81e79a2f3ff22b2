"""The daemon's status answers: this node (``/v1/node``) and the cluster as it sees it (``/v1/cluster``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent import __version__
from agent.common.paths import log_dir
from agent.node.views import live_peers

if TYPE_CHECKING:
    from agent.node.daemon import AgentDaemon


def node_status(d: AgentDaemon) -> dict[str, Any]:
    e = d.elector
    return {
        "node": d.node,
        "name": d.me.name,
        "cluster": d.settings.cluster_id,
        "version": __version__,
        "model": d.effective_model().to_json(),  # what it serves when elected, and why
        "state": d.me.state,
        "reason": d.me.reason,
        "paused_until": d.contrib.manual_until,
        "throttle": d.contrib.status(),
        "tok_s": d.me.tok_s,
        "temp_c": d.me.temp_c,
        "role": str(e.role) if e else "standalone",
        "term": d.store.state.term,
        "coordinator": e.leader() if e else None,
        "port": d.me.port,
        "api_port": d.api_port,
        "mdns": d.discovery is not None,
        "links": d.links,
        "mem_total": d.me.mem_total,
        "mem_free": d.me.mem_free(),
        "speed_score": d.me.score,
        "devices": list(d.me.devices),
        "devices_detail": [
            {"name": o.name, "score": o.score, "mem_free": o.mem_free, "own_memory": o.own_memory}
            for o in d.me.device_offers(min(d.me.mem_free(), d.me.mem_total))
        ],
        "capacity": d.capacity,
        "stage": d.host.status(),
        "exports": d.copies.status(),
        "log_dir": str(log_dir()),
        "config_file": str(d.config_path) if d.config_path else None,
        "started": d.started,
        "peers": live_peers(d),
    }


def cluster_status(d: AgentDaemon) -> dict[str, Any]:
    if d.elector is None:
        return {"node": d.node, "role": "standalone", "peers": [], "coordinator": None, "term": 0}
    st = d.elector.status()
    st["links"] = d.links
    sv = d.services
    st["services"] = None if sv is None else {**sv.status(), "weights": sv.weights, "draft": sv.draft}
    if d.no_services:
        st["no_services"] = d.no_services
    st["model"] = d.effective_model().to_json()
    st["cluster_settings"] = d.cluster_settings.status()
    st["assignments_refused"] = d.fence.refused  # not from the coordinator of their term
    st["revocation"] = d.gossip.status() if d.gossip is not None else None
    return st
