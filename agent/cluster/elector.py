"""The election's messaging: beats, votes and fencing between agents over UDP.

Decisions come from :mod:`agent.cluster.election` (pure functions); this module keeps the peer
table, sends and receives the datagrams, persists terms before acting on them, and records
every coordinator it admitted (``history``) so tests and admins can audit the fencing.
With cluster credentials every datagram is signed and checked (:mod:`agent.security.datagrams`).
Everything here runs on the event loop (``async_`` methods and datagram callbacks).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from agent.cluster.election import (
    Action,
    Role,
    Situation,
    Standing,
    Timing,
    admit,
    can_stand,
    deposed,
    election_delay,
    pin_rank,
    stand,
    step,
    vote,
    yields_to,
)
from agent.cluster.node_state import TermStore
from agent.common.config import Settings
from agent.protocol import Ack, Beat, DeviceOffer, Message, StageReport, Vote, VoteRequest
from agent.protocol.control import MAX_HELD
from agent.security.datagrams import Datagrams, Plain, Receiver, Refused

log = logging.getLogger(__name__)
TICK_S = 0.05
FORGET_S = 30.0  # a peer neither heard from nor advertised for this long leaves the table


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
    reason: str | None = None  # why it is limited or paused
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


class Elector:
    def __init__(
        self,
        me: LocalNode,
        settings: Settings,
        store: TermStore,
        timing: Timing | None = None,
        datagrams: Datagrams | None = None,  # signed with credentials (agent.security.datagrams)
    ) -> None:
        self.me, self.settings, self.store = me, settings, store
        self.datagrams = datagrams or Plain()
        self.timing = timing or Timing()
        self.role = Role.FOLLOWER
        self.peers: dict[str, Peer] = {}
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=100)
        self.on_term: Callable[[int], None] | None = None  # tells the stage server about new terms
        # every beat taken (signed and checked, with credentials) and where it came from: gossip
        self.on_beat_heard: Callable[[Beat, tuple[str, int]], None] | None = None
        now = time.monotonic()
        self.started = now
        self.leader_last = now  # last beat of the coordinator we follow (start: give discovery a chance)
        self.leader_since: float | None = None  # wall clock when the current coordinator was admitted
        self.stood_at = float("-inf")
        self.granted_at = float("-inf")  # when this node last granted its vote (its election clock restarts)
        self.ticked = now  # the clock's last tick: a longer gap than the peer timeout is a stall of the loop
        self.back_until = float("-inf")  # after such a stall: newer terms are successors, not challengers
        self.votes: set[str] = set()
        self.view = 1
        self.followers: dict[str, float] = {}
        self.delay = self._new_delay()
        self.elections = 0
        self.refused = 0
        self.dropped = 0
        self._last_beat = float("-inf")
        self._beat_sent: float | None = None  # when our last beat as coordinator left (for round trips)
        self._transport: asyncio.DatagramTransport | None = None
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    async def async_start(self, host: str = "0.0.0.0") -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: Receiver(self.on_datagram), local_addr=(host, self.me.port), reuse_port=False
        )
        self._transport = transport
        self._task = asyncio.create_task(self._run())

    async def async_shutdown(self) -> None:
        if self.role is Role.COORDINATOR:
            self.role = Role.FOLLOWER
            self._beat_all()  # tell the others at once, so they need not wait for a timeout
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._transport is not None:
            self._transport.close()

    async def _run(self) -> None:
        while True:
            try:
                self._tick(time.monotonic())
            except Exception:
                log.exception("election tick failed")
            await asyncio.sleep(TICK_S)

    # -- what this node offers ------------------------------------------------------------------
    def standing(self) -> Standing:
        mem = self.me.mem_free()
        ok = can_stand(self.me.node, self.me.state, mem, self.settings) is None
        return Standing(self.me.node, ok, self.me.score, mem)

    def _alive(self, now: float) -> list[Peer]:
        return [p for p in self.peers.values() if now - p.last_heard < self.timing.peer_timeout_s]

    def _new_delay(self) -> float:
        now = time.monotonic()
        others = [p.standing() for p in self._alive(now)]
        return election_delay(self.standing(), others, self.settings, self.timing, random.random())

    def leader(self, now: float | None = None) -> str | None:
        """The coordinator this node follows right now (itself when coordinating)."""
        now = time.monotonic() if now is None else now
        if self.role is Role.COORDINATOR:
            return self.me.node
        ld = self.store.state.leader
        if ld is None or ld == self.me.node or now - self.leader_last >= self.timing.peer_timeout_s:
            return None
        return ld

    # -- the clock ------------------------------------------------------------------------------
    def _woke(self, now: float) -> None:
        """Notice a stall of the event loop longer than the peer timeout (a busy laptop): the peers
        have counted this node gone meanwhile, and what arrives now may be an election it missed."""
        if now - self.ticked > self.timing.peer_timeout_s:
            if self.role is Role.COORDINATOR:
                log.info("back after %.1f s without a tick: newer terms are taken as successors", now - self.ticked)
            self.back_until = now + self.timing.peer_timeout_s
            self.ticked = now

    @property
    def stalled(self) -> bool:
        """Whether this node has just come back from a stall (see :meth:`_woke`)."""
        return time.monotonic() < self.back_until

    def _tick(self, now: float) -> None:
        self._woke(now)
        self.ticked = now
        sit = Situation(
            role=self.role,
            me=self.standing(),
            leader=self.leader(now) if self.role is Role.FOLLOWER else None,
            since_leader_s=now - max(self.leader_last, self.granted_at),
            election_delay_s=self.delay,
            votes=len(self.votes),
            view=self.view,
            since_election_s=now - self.stood_at,
        )
        act = step(sit, self.settings, self.timing)
        if act is Action.START_ELECTION:
            self._stand(0)
        elif act is Action.BECOME_COORDINATOR:
            self._lead()
        elif act is Action.GIVE_UP:
            log.info("no majority for term %d (%d of %d votes)", self.store.state.term, len(self.votes), self.view)
            self._follow()
        elif act is Action.STEP_DOWN:
            why = can_stand(self.me.node, self.me.state, sit.me.mem_free, self.settings)
            log.info("stepping down as coordinator: %s", why)
            self._follow()
            self._beat_all()
        if now - self._last_beat >= self.timing.beat_s:
            self._beat_all()
            if self.role is Role.CANDIDATE:
                self._ask_votes(now)
        for node, p in list(self.peers.items()):
            if now - max(p.last_heard, p.last_advert) > FORGET_S:
                del self.peers[node]

    # -- transitions ----------------------------------------------------------------------------
    def _save(self, ts: Any) -> None:
        old = self.store.state
        self.store.save(ts)
        if ts.leader is not None and (ts.term, ts.leader) != (old.term, old.leader):
            self.leader_since = time.time()
            self.history.append({"term": ts.term, "coordinator": ts.leader, "at": self.leader_since})
            log.info("term %d: coordinator %s", ts.term, ts.leader)
        if ts.term != old.term and self.on_term is not None:
            self.on_term(ts.term)

    def _stand(self, above: int) -> None:
        now = time.monotonic()
        self._save(stand(self.store.state, self.me.node, above))
        self.role, self.votes, self.stood_at = Role.CANDIDATE, {self.me.node}, now
        self.view = 1 + len(self._alive(now))
        self.elections += 1
        log.info("standing for coordinator in term %d (view of %d)", self.store.state.term, self.view)
        self._beat_all()
        self._ask_votes(now)

    def _lead(self) -> None:
        ts = self.store.state
        self.role = Role.COORDINATOR
        self.followers.clear()
        self._save(type(ts)(ts.term, self.me.node, self.me.node))
        self._beat_all()

    def _follow(self) -> None:
        self.role = Role.FOLLOWER
        self.votes.clear()
        self.delay = self._new_delay()

    def _step_aside(self, term: int, why: str) -> None:
        """A coordinator replaced in ``term`` (see :func:`deposed`) follows, and gives the newer
        coordinator a whole election delay to reach it before it would stand itself."""
        log.info("stepping aside for term %d: %s", term, why)
        self._follow()
        self.leader_last = time.monotonic()

    # -- sending --------------------------------------------------------------------------------
    def _send(self, msg: Message, addr: tuple[str, int]) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        try:
            self._transport.sendto(self.datagrams.seal(msg, addr), addr)
        except OSError as e:  # an unplugged link; the peer will time out
            log.debug("send to %s failed: %s", addr, e)

    def _targets(self) -> set[tuple[str, int]]:
        known = {p.addr for p in self.peers.values()}
        return known | set(self.settings.static_peers)

    def _beat_all(self) -> None:
        self._last_beat = time.monotonic()
        st, ts = self.standing(), self.store.state
        now = time.monotonic()
        alive_followers = sum(1 for t in self.followers.values() if now - t < self.timing.peer_timeout_s)
        mem_free = min(st.mem_free, self.me.mem_total)
        beat = Beat(
            cluster=self.me.cluster,
            node=self.me.node,
            port=self.me.port,
            term=ts.term,
            role=str(self.role),
            leader=self.leader(now),
            state=self.me.state,
            eligible=st.eligible,
            score=self.me.score,
            mem_free=mem_free,
            mem_total=self.me.mem_total,
            devices=self.me.devices,
            version=self.me.version,
            followers=alive_followers if self.role is Role.COORDINATOR else 0,
            name=self.me.name,
            reason=self.me.reason,
            temp_c=self.me.temp_c,
            tok_s=self.me.tok_s,
            next_rtt_ms=self.me.next_rtt_ms,
            offers=self.me.device_offers(mem_free),
            revocation=self.datagrams.revocation_version(),
            serving=self.me.serving,
            exports=self.me.exports[:MAX_HELD],
            needed=min(self.me.needed, MAX_HELD),
            settings=self.me.settings,
        )
        self._beat_sent = now if self.role is Role.COORDINATOR else None
        for addr in self._targets():
            self._send(beat, addr)

    def _ask_votes(self, now: float) -> None:
        st = self.standing()
        req = VoteRequest(
            cluster=self.me.cluster,
            node=self.me.node,
            port=self.me.port,
            term=self.store.state.term,
            eligible=st.eligible,
            score=self.me.score,
            mem_free=st.mem_free,
        )
        for p in self._alive(now):
            if p.node not in self.votes:
                self._send(req, p.addr)

    # -- receiving ------------------------------------------------------------------------------
    def on_datagram(self, data: bytes, src: tuple[str, int]) -> None:
        try:
            msg = self.datagrams.open(data, src)  # signed and checked, in a cluster with credentials
        except Refused as e:
            self._drop(e.code, e.why)
            return
        cluster = getattr(msg, "cluster", None)
        if cluster is None:
            self._drop("unexpected", f"unexpected {msg.TYPE!r} datagram from {src[0]}")
            return
        if cluster != self.me.cluster:
            self._drop("other_cluster", f"{src[0]} belongs to cluster {cluster!r}, not ours")
            return
        node: str = msg.node  # type: ignore[attr-defined]
        if node == self.me.node:
            return  # our own datagram (a static peer list that names this node)
        self._woke(time.monotonic())
        port = msg.port if isinstance(msg, Beat | VoteRequest) else src[1]
        p = self.peers.get(node)
        if p is None:
            p = self.peers[node] = Peer(node, (src[0], port))
            log.info("new peer %s at %s:%d", node, src[0], port)
        p.addr, p.last_heard = (src[0], port), time.monotonic()
        if p.first_heard is None:
            p.first_heard = time.time()
        if isinstance(msg, Beat):
            first, p.beat = p.beat is None, msg
            if first and self.role is Role.FOLLOWER:  # a peer's first beat: this node's rank, so its delay, anew
                self.delay = self._new_delay()
            if msg.role == "coordinator":
                p.last_led = p.last_heard
            if self.on_beat_heard is not None:
                try:
                    self.on_beat_heard(msg, src)
                except Exception:
                    log.exception("beat hook failed")
            self._on_beat(msg, p, src)
        elif isinstance(msg, VoteRequest):
            self._on_vote_request(msg, p, src)
        elif isinstance(msg, Vote):
            self._on_vote(msg)
        elif isinstance(msg, Ack):
            self._on_ack(msg, p)

    def _drop(self, code: str, why: str) -> None:
        self.dropped += 1
        self.datagrams.note(code, why)  # counted by code; logged at most every few seconds per code

    def _ack(self, to: tuple[str, int], accepted: bool, code: str | None = None, message: str | None = None) -> None:
        ts = self.store.state
        self._send(Ack(self.me.cluster, self.me.node, ts.term, self.leader(), accepted, code, message), to)

    def _on_beat(self, b: Beat, p: Peer, src: tuple[str, int]) -> None:
        ts = self.store.state
        if b.role != "coordinator":
            if self.store.state.leader == b.node and self.leader_last > time.monotonic() - self.timing.peer_timeout_s:
                # our coordinator stepped down: the election clock runs as if it had timed out now
                self.leader_last = time.monotonic() - self.timing.peer_timeout_s
            if self.role is Role.COORDINATOR and b.term > ts.term:
                if deposed(b.term, ts.term, b.leader, self.me.node, self.stalled):
                    self._step_aside(b.term, f"{b.node} follows {b.leader or 'a newer election'}")
                elif self.standing().eligible:
                    self._stand(b.term)  # someone stood while we still lead: fence above their term
            return
        if self.role is Role.COORDINATOR and b.term >= ts.term:  # two coordinators met (a healed partition)
            newer = deposed(b.term, ts.term, b.node, self.me.node, self.stalled)
            if not newer and not yields_to(self.standing(), p.standing(), self.settings):
                self.refused += 1
                self._ack(src, False, "term_conflict", f"{self.me.node} coordinates term {ts.term}")
                self._stand(b.term)  # stay, in a term above both
                return
            log.info("yielding to coordinator %s (term %d)", b.node, b.term)
            self._follow()
        ts2, refusal = admit(ts, b.term, b.node)
        if refusal is not None:
            self.refused += 1
            log.info("refused a command from %s: %s", b.node, refusal.message)
            self._ack(src, False, refusal.code, refusal.message)
            return
        if self.role is Role.CANDIDATE:
            self._follow()
        self._save(ts2)
        self.leader_last = time.monotonic()
        self._ack(src, True)

    def _on_vote_request(self, r: VoteRequest, p: Peer, src: tuple[str, int]) -> None:
        ts = self.store.state
        cand = Standing(r.node, r.eligible, r.score, r.mem_free)
        live = self.leader()
        if self.role is Role.COORDINATOR and r.term > ts.term:
            was_coordinator = time.monotonic() - p.last_led < self.timing.peer_timeout_s
            outranks = pin_rank(r.node, self.settings) > pin_rank(self.me.node, self.settings)
            if outranks or self.stalled or (was_coordinator and yields_to(self.standing(), cand, self.settings)):
                log.info("handing over to %s (term %d)", r.node, r.term)
                self._follow()
                live = None
        ts2, refusal = vote(ts, r.term, cand, live, self.settings)
        if refusal is None:
            self.granted_at = time.monotonic()
            self._save(ts2)
            if self.role is not Role.FOLLOWER and r.term > ts.term:
                self._follow()
            self.leader_last = max(self.leader_last, time.monotonic() - self.timing.peer_timeout_s)
        elif self.role is Role.COORDINATOR and r.term > ts.term:
            self._stand(r.term)  # keep leading, in a term above the would-be usurper's
        ts = self.store.state
        granted = refusal is None
        self._send(
            Vote(
                self.me.cluster,
                self.me.node,
                r.term,
                ts.term,
                granted,
                None if granted else refusal.code,  # type: ignore[union-attr]
                None if granted else refusal.message,  # type: ignore[union-attr]
            ),
            src,
        )

    def _on_vote(self, v: Vote) -> None:
        ts = self.store.state
        if self.role is not Role.CANDIDATE or v.term != ts.term:
            return
        if v.granted:
            self.votes.add(v.node)
        elif v.voter_term > ts.term:
            self._follow()

    def _on_ack(self, a: Ack, p: Peer) -> None:
        ts = self.store.state
        if self.role is not Role.COORDINATOR:
            return
        if a.accepted and a.term == ts.term:
            now = time.monotonic()
            self.followers[a.node] = now
            if self._beat_sent is not None and now - self._beat_sent < self.timing.beat_s:
                rtt = (now - self._beat_sent) * 1000
                p.rtt_ms = rtt if p.rtt_ms is None else 0.7 * p.rtt_ms + 0.3 * rtt
            return
        if a.term < ts.term:
            return  # an answer to an older beat
        if deposed(a.term, ts.term, a.leader, self.me.node, self.stalled):
            self._step_aside(a.term, f"{a.node} follows {a.leader or 'a newer election'}")
            return
        other = self.peers.get(a.leader) if a.leader else None
        led = other is not None and time.monotonic() - other.last_led < self.timing.peer_timeout_s
        if other is not None and led and yields_to(self.standing(), other.standing(), self.settings):
            log.info("yielding to coordinator %s", other.node)
            self._follow()
            return
        self._stand(a.term)

    # -- discovery ------------------------------------------------------------------------------
    def on_advert(self, node: str, addr: tuple[str, int]) -> None:
        p = self.peers.get(node)
        if p is None:
            p = self.peers[node] = Peer(node, addr)
            log.info("discovered %s at %s:%d", node, *addr)
        elif time.monotonic() - p.last_heard > self.timing.peer_timeout_s:
            p.addr = addr  # prefer the address its beats come from while it beats
        p.last_advert = time.monotonic()

    def on_goodbye(self, node: str) -> None:
        p = self.peers.get(node)
        if p is not None:
            p.last_advert = float("-inf")

    # -- status ---------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now, wall = time.monotonic(), time.time()
        ts = self.store.state
        peers = []
        for p in sorted(self.peers.values(), key=lambda x: x.node):
            b = p.beat
            peers.append(
                {
                    "node": p.node,
                    "address": f"{p.addr[0]}:{p.addr[1]}",
                    "alive": now - p.last_heard < self.timing.peer_timeout_s,
                    "last_heard_s": None if p.last_heard == float("-inf") else round(now - p.last_heard, 3),
                    "first_seen": p.first_seen,
                    "first_heard": p.first_heard,
                    "role": b.role if b else None,
                    "term": b.term if b else None,
                    "state": b.state if b else None,
                    "eligible": b.eligible if b else None,
                    "score": b.score if b else None,
                    "mem_free": b.mem_free if b else None,
                    "devices": list(b.devices) if b else [],
                    "offers": [
                        {"name": o.name, "score": o.score, "mem_free": o.mem_free, "own_memory": o.own_memory}
                        for o in b.offers
                    ]
                    if b
                    else [],
                    "version": b.version if b else None,
                    "name": b.name if b else None,
                    "reason": b.reason if b else None,
                    "rtt_ms": None if p.rtt_ms is None else round(p.rtt_ms, 2),
                }
            )
        leader = self.leader(now)
        return {
            "node": self.me.node,
            "cluster": self.me.cluster,
            "role": str(self.role),
            "term": ts.term,
            "coordinator": leader,
            "coordinator_since": self.leader_since if leader else None,
            "eligible": self.standing().eligible,
            "state": self.me.state,
            "reason": self.me.reason,
            "not_eligible_because": can_stand(self.me.node, self.me.state, self.me.mem_free(), self.settings),
            "peers": peers,
            "history": list(self.history),
            "elections_started": self.elections,
            "commands_refused": self.refused,
            "datagrams_ignored": self.dropped,
            "election_traffic": self.datagrams.status(),  # signed or plaintext; refusals by code
            "time": wall,
        }
