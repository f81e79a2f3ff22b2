"""What the election knows of each node: this one (:class:`LocalNode`, which its beats announce)
and the others (:class:`Peer`, from their datagrams and adverts), and how status pages show a peer."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from agent.cluster.election import Standing
from agent.protocol import Beat, DeviceOffer, StageReport
from agent.protocol.control import MAX_HELD


@dataclass
class LocalNode:
    """What this node offers; the daemon keeps it current (capacity probe, throttle, status API)."""

    node: str
    cluster: str
    port: int
    version: str
    mem_total: int
    mem_free: Callable[[], int]
    state: str = "available"
    score: float = 0.0
    devices: tuple[str, ...] = ("CPU",)
    name: str | None = None  # host name, for node maps
    reason: str | None = None  # why it is limited or paused, in words
    reason_kind: str | None = None  # the same as a PauseReason value (agent.protocol.status), for programs
    temp_c: float | None = None
    tok_s: float = 0.0
    next_rtt_ms: float | None = None
    # each device it offers (capacity probe); a shared-memory device's mem_free is replaced by the
    # node's fresh figure in every beat, an own-memory device's (a discrete GPU) the daemon keeps current
    offers: tuple[DeviceOffer, ...] = ()
    serving: StageReport | None = None  # the stage it serves now
    exports: tuple[str, ...] = ()  # the exports it holds whole (content ids; the cluster's first, then newest)
    needed: int = 0  # while it coordinates: how many of the first ``exports`` every member should copy
    # the cluster settings document it holds, (version, set_by), which its beats announce
    settings: tuple[int, str] | None = None

    def device_offers(self, mem_free: int) -> tuple[DeviceOffer, ...]:
        """The offers as beats carry them: shared-memory devices with ``mem_free``, the node's figure."""
        return tuple(o if o.own_memory else replace(o, mem_free=mem_free) for o in self.offers)

    def beat(self, term: int, role: str, leader: str | None, eligible: bool, followers: int, revocation: Any) -> Beat:
        """This node's beat now: what it offers, its role and term, the coordinator it follows."""
        mem_free = min(self.mem_free(), self.mem_total)
        return Beat(
            cluster=self.cluster,
            node=self.node,
            port=self.port,
            term=term,
            role=role,
            leader=leader,
            state=self.state,
            eligible=eligible,
            score=self.score,
            mem_free=mem_free,
            mem_total=self.mem_total,
            devices=self.devices,
            version=self.version,
            followers=followers,
            name=self.name,
            reason=self.reason,
            reason_kind=self.reason_kind,
            temp_c=self.temp_c,
            tok_s=self.tok_s,
            next_rtt_ms=self.next_rtt_ms,
            offers=self.device_offers(mem_free),
            revocation=revocation,
            serving=self.serving,
            exports=self.exports[:MAX_HELD],
            needed=min(self.needed, MAX_HELD),
            settings=self.settings,
        )


@dataclass
class Peer:
    node: str
    addr: tuple[str, int]
    first_seen: float = field(default_factory=time.time)  # wall clock: advertised or heard
    first_heard: float | None = None  # wall clock: its first datagram
    last_heard: float = float("-inf")  # monotonic; beats and replies
    last_advert: float = float("-inf")  # monotonic; mDNS
    last_led: float = float("-inf")  # monotonic; its last beat as a coordinator
    beat: Beat | None = None
    rtt_ms: float | None = None  # while we coordinate: beat -> acknowledgement, smoothed

    def standing(self) -> Standing:
        b = self.beat
        return Standing(self.node, b.eligible, b.score, b.mem_free) if b else Standing(self.node, False)

    def row(self, now: float, timeout_s: float) -> dict[str, Any]:
        """This peer as ``/v1/cluster`` lists it (its latest beat's figures, None before one)."""
        b = self.beat
        return {
            "node": self.node,
            "address": f"{self.addr[0]}:{self.addr[1]}",
            "alive": now - self.last_heard < timeout_s,
            "last_heard_s": None if self.last_heard == float("-inf") else round(now - self.last_heard, 3),
            "first_seen": self.first_seen,
            "first_heard": self.first_heard,
            "role": b.role if b else None,
            "term": b.term if b else None,
            "state": b.state if b else None,
            "eligible": b.eligible if b else None,
            "score": b.score if b else None,
            "mem_free": b.mem_free if b else None,
            "devices": list(b.devices) if b else [],
            "offers": [
                {"name": o.name, "score": o.score, "mem_free": o.mem_free, "own_memory": o.own_memory} for o in b.offers
            ]
            if b
            else [],
            "version": b.version if b else None,
            "name": b.name if b else None,
            "reason": b.reason if b else None,
            "reason_kind": b.reason_kind if b else None,
            "rtt_ms": None if self.rtt_ms is None else round(self.rtt_ms, 2),
        }
