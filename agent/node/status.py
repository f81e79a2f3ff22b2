"""The daemon's status answers: this node (``/v1/node``) and the cluster as it sees it (``/v1/cluster``),
built as the typed :mod:`agent.protocol.status` models and sent as their JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent import __version__
from agent.common.paths import log_dir
from agent.node.views import live_peers
from agent.protocol.status import (
    ClusterStatus,
    NodeStatus,
    PauseReason,
    StageStatus,
    ThrottlePolicy,
    reason_kind_field,
)
from agent.throttle.settings import format_hours

if TYPE_CHECKING:
    from agent.node.daemon import AgentDaemon


def _kind(d: AgentDaemon) -> PauseReason | None:
    return reason_kind_field(d.me.reason_kind) if d.me.state != "available" else None


def throttle_policy(d: AgentDaemon) -> ThrottlePolicy:
    """The settings its throttle runs with, as ``/v1/node`` tells the tray (when a pause ends)."""
    t = d.settings.throttle
    return ThrottlePolicy(
        enabled=d.contrib.enabled,
        idle_minutes=t.idle_minutes,
        while_in_use=t.while_in_use,
        temp_low_c=t.temp_low_c,
        on_battery=t.on_battery,
        battery_floor_pct=t.battery_floor_pct,
        cpu_low_pct=round(t.cpu_low * 100, 3),
        gpu_low_pct=round(t.gpu_low * 100, 3),
        hours=format_hours(t.hours),
        input_waived=d.contrib.input_waived,
    )


def node_status(d: AgentDaemon) -> dict[str, Any]:
    return node_model(d).to_json()


def node_model(d: AgentDaemon) -> NodeStatus:
    e = d.elector
    return NodeStatus(
        node=d.node,
        name=d.me.name,
        cluster=d.settings.cluster_id,
        version=__version__,
        state=d.me.state,
        reason=d.me.reason,
        reason_kind=_kind(d),
        paused_until=d.contrib.manual_until,
        throttle_policy=throttle_policy(d),
        tok_s=d.me.tok_s,
        temp_c=d.me.temp_c,
        role=str(e.role) if e else "standalone",
        term=d.store.state.term,
        coordinator=e.leader() if e else None,
        port=d.me.port,
        api_port=d.api_port,
        mdns=d.discovery is not None,
        links=d.links,
        mem_total=d.me.mem_total,
        mem_free=d.me.mem_free(),
        speed_score=d.me.score,
        devices=tuple(d.me.devices),
        stage=StageStatus.parse(d.host.status()),
        log_dir=str(log_dir()),
        config_file=str(d.config_path) if d.config_path else None,
        started=d.started,
        peers=live_peers(d),
        details={  # what no reader needs typed: shown by 'lakeshard status --json' and the doctor
            "model": d.effective_model().to_json(),  # what it serves when elected, and why
            "throttle": d.contrib.status(),
            "devices_detail": [
                {"name": o.name, "score": o.score, "mem_free": o.mem_free, "own_memory": o.own_memory}
                for o in d.me.device_offers(min(d.me.mem_free(), d.me.mem_total))
            ],
            "capacity": d.capacity,
            "exports": d.copies.status(),
        },
    )


def cluster_status(d: AgentDaemon) -> dict[str, Any]:
    if d.elector is None:
        return ClusterStatus(node=d.node, role="standalone").to_json()
    st = d.elector.status()
    st["reason_kind"] = None if (k := _kind(d)) is None else k.value
    st["links"] = d.links
    sv = d.services
    st["services"] = None if sv is None else {**sv.status(), "weights": sv.weights, "draft": sv.draft}
    if d.no_services:
        st["no_services"] = d.no_services
    st["model"] = d.effective_model().to_json()
    st["cluster_settings"] = d.cluster_settings.status()
    st["assignments_refused"] = d.fence.refused  # not from the coordinator of their term
    st["revocation"] = d.gossip.status() if d.gossip is not None else None
    return ClusterStatus.parse(st).to_json()  # checked on the way out too: the election's own figures
