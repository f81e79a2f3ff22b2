"""What the daemon hears, as its parts want it: the members a coordinator plans over, the nodes a
node map shows, the live peers exports are copied from, where the coordinator's services are, and
whether an address is a member's. Built afresh from the election's peer table (its latest beats)."""

from __future__ import annotations

import contextlib
import ipaddress
import time
from typing import TYPE_CHECKING

from agent.api.gateway import Target
from agent.cluster.offers import Member, NodeOffer
from agent.node.replication import HeardPeer
from agent.protocol.cluster_view import NodeInfo

if TYPE_CHECKING:
    from agent.node.daemon import AgentDaemon


def my_ip(d: AgentDaemon) -> str:
    from agent.cluster.discovery import local_addresses

    ips = local_addresses(d.settings.interface)
    return ips[0] if ips else "127.0.0.1"


def heard_peers(d: AgentDaemon) -> list[HeardPeer]:
    """Live peers with their latest beats, the coordinator first."""
    e = d.elector
    if e is None:
        return []
    now, leader = time.monotonic(), e.leader()
    out = [
        HeardPeer(p.node, f"{p.addr[0]}:{p.beat.port}", p.beat)
        for p in e.peers.values()
        if p.beat is not None and now - p.last_heard < e.timing.peer_timeout_s
    ]
    return sorted(out, key=lambda h: h.node != leader)


def members(d: AgentDaemon) -> list[Member]:
    e = d.elector
    assert e is not None
    me = d.me
    here = f"{my_ip(d)}:{me.port}"
    mem = min(me.mem_free(), me.mem_total)
    serving, holds = d.host.report(), me.exports
    out = [
        Member(NodeOffer(me.node, o.mem_free, max(o.score, 1.0), me.state, o.name), here, me.score > 0, serving, holds)
        for o in me.device_offers(mem)
    ] or [Member(NodeOffer(me.node, mem, max(me.score, 1.0), me.state), here, me.score > 0, serving, holds)]
    now = time.monotonic()
    for p in e.peers.values():
        b = p.beat
        if b is None or now - p.last_heard >= e.timing.peer_timeout_s:
            continue
        there = f"{p.addr[0]}:{b.port}"
        offers = [NodeOffer(p.node, o.mem_free, max(o.score, 1.0), b.state, o.name) for o in b.offers]
        for offer in offers or [NodeOffer(p.node, b.mem_free, max(b.score, 1.0), b.state)]:
            out.append(Member(offer, there, b.score > 0, b.serving, b.exports))
    return out


def node_infos(d: AgentDaemon) -> list[NodeInfo]:
    """Every node this one hears right now (itself first), as node maps show them."""
    e = d.elector
    me, st = d.me, d.host.status()
    role = str(e.role) if e else "standalone"
    out = [
        NodeInfo(
            node=me.node,
            name=me.name or me.node,
            address=f"{my_ip(d)}:{me.port}",
            role=role,
            state=me.state,
            reason=me.reason,
            devices=me.devices,
            mem_free=min(me.mem_free(), me.mem_total),
            mem_total=me.mem_total,
            score=me.score,
            temp_c=me.temp_c,
            tok_s=me.tok_s,
            rtt_ms=0.0,
            next_rtt_ms=me.next_rtt_ms,
            stage=st["stage"],
            layers=tuple(st["layers"]) if st["layers"] else None,
            version=me.version,
        )
    ]
    if e is None:
        return out
    now = time.monotonic()
    for p in e.peers.values():
        b = p.beat
        if b is None or now - p.last_heard >= e.timing.peer_timeout_s:
            continue
        out.append(
            NodeInfo(
                node=p.node,
                name=b.name or p.node,
                address=f"{p.addr[0]}:{b.port}",
                role=b.role,
                state=b.state,
                reason=b.reason,
                devices=b.devices,
                mem_free=b.mem_free,
                mem_total=b.mem_total,
                score=b.score,
                temp_c=b.temp_c,
                tok_s=b.tok_s,
                rtt_ms=None if p.rtt_ms is None else round(p.rtt_ms, 2),
                next_rtt_ms=b.next_rtt_ms,
                version=b.version,
            )
        )
    return out


def coordinator_target(d: AgentDaemon) -> Target | None:
    """Where the coordinator's services are (see :mod:`agent.api.gateway`); None during an election."""
    e = d.elector
    if e is None:
        return None
    leader = e.leader()
    if leader is None:
        return None
    if leader == d.node:
        sv = d.services
        if sv is None:
            return None
        return Target(d.node, api=sv.api_base(), hub=sv.hub, not_ready=sv.not_ready())
    p = e.peers.get(leader)
    if p is None or p.beat is None:
        return None
    return Target(leader, peer=f"{p.addr[0]}:{p.beat.port}")


def is_member_address(d: AgentDaemon, ip: str) -> bool:
    """Whether ``ip`` is a live peer's (the public port serves the coordinator to members only)."""
    e = d.elector
    if e is None:
        return False
    with contextlib.suppress(ValueError):
        addr = ipaddress.ip_address(ip)
        if addr.version == 6 and addr.ipv4_mapped is not None:
            ip = str(addr.ipv4_mapped)
    now = time.monotonic()
    return any(p.addr[0] == ip and now - p.last_heard < e.timing.peer_timeout_s for p in e.peers.values())


def live_peers(d: AgentDaemon) -> int:
    e = d.elector
    if e is None:
        return 0
    now = time.monotonic()
    return sum(1 for p in e.peers.values() if now - p.last_heard < e.timing.peer_timeout_s)
