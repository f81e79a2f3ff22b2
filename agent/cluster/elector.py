"""The election's messaging: beats, votes and fencing between agents over UDP.

Decisions come from :mod:`agent.cluster.election` (pure functions). This module owns the socket
and the clock and handles each datagram; :mod:`agent.cluster.elector_state` keeps the peer table
and the terms (persisted before acting on them), moves between roles, sends, and records every
coordinator admitted (``history``) so tests and admins can audit the fencing; what each node
offers and each peer announced is in :mod:`agent.cluster.peers`.
With cluster credentials every datagram is signed and checked (:mod:`agent.security.datagrams`).
Everything here runs on the event loop (``async_`` methods and datagram callbacks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from agent.cluster.election import (
    Action,
    Role,
    Situation,
    Standing,
    admit,
    can_stand,
    deposed,
    pin_rank,
    step,
    vote,
    yields_to,
)
from agent.cluster.elector_state import ElectorState
from agent.cluster.peers import LocalNode, Peer
from agent.protocol import Ack, Beat, Vote, VoteRequest
from agent.security.datagrams import Receiver, Refused

__all__ = ["Elector", "LocalNode", "Peer"]  # (LocalNode and Peer live in agent.cluster.peers)

log = logging.getLogger(__name__)
TICK_S = 0.05
FORGET_S = 30.0  # a peer neither heard from nor advertised for this long leaves the table


class Elector(ElectorState):
    """The election on this node: its UDP socket, its clock, and what it does with each datagram."""

    # -- lifecycle -----------------------------------------------------------------------------
    async def async_start(self, host: str = "0.0.0.0") -> None:
        """Listen on UDP ``me.port``; port 0 takes a free one, which ``me.port`` then holds (beats announce it)."""
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: Receiver(self.on_datagram), local_addr=(host, self.me.port), reuse_port=False
        )
        self._transport = transport
        self.me.port = int(transport.get_extra_info("sockname")[1])
        self._task = asyncio.create_task(self._run())

    async def async_stop(self) -> None:
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

    def status(self) -> dict[str, Any]:
        now, wall = time.monotonic(), time.time()
        ts = self.store.state
        timeout = self.timing.peer_timeout_s
        peers = [p.row(now, timeout) for p in sorted(self.peers.values(), key=lambda x: x.node)]
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
