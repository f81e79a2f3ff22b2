"""The election's state on this node and the moves between its roles (see :mod:`agent.cluster.elector`).

:class:`ElectorState` holds the peer table, the term store, the votes and the clocks; it sends
beats, vote requests and acknowledgements, and moves between follower, candidate and coordinator.
Its subclass :class:`agent.cluster.elector.Elector` adds the socket, the clock's tick and the
handling of what arrives. Whoever runs the coordinator's services is told of every change of role
or term through ``on_change`` (no polling).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from agent.cluster.election import Role, Standing, Timing, can_stand, election_delay, stand
from agent.cluster.node_state import TermStore
from agent.cluster.peers import LocalNode, Peer
from agent.common.config import Settings
from agent.protocol import Ack, Beat, Message, VoteRequest
from agent.security.datagrams import Datagrams, Plain

log = logging.getLogger("agent.cluster.elector")


class ElectorState:
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
        self._role = Role.FOLLOWER
        self.on_change: Callable[[], None] | None = None  # the role or the term changed
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

    @property
    def role(self) -> Role:
        return self._role

    @role.setter
    def role(self, role: Role) -> None:
        if role is not self._role:
            self._role = role
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:
                log.exception("role change hook failed")

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

    # -- transitions ----------------------------------------------------------------------------
    def _save(self, ts: Any) -> None:
        old = self.store.state
        self.store.save(ts)
        if ts.leader is not None and (ts.term, ts.leader) != (old.term, old.leader):
            self.leader_since = time.time()
            self.history.append({"term": ts.term, "coordinator": ts.leader, "at": self.leader_since})
            log.info("term %d: coordinator %s", ts.term, ts.leader)
        if ts.term != old.term:
            if self.on_term is not None:
                self.on_term(ts.term)
            self._changed()

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
        now = self._last_beat = time.monotonic()
        ts = self.store.state
        alive_followers = sum(1 for t in self.followers.values() if now - t < self.timing.peer_timeout_s)
        coordinating = self.role is Role.COORDINATOR
        beat = self.me.beat(
            ts.term,
            str(self.role),
            self.leader(now),
            self.standing().eligible,
            alive_followers if coordinating else 0,
            self.datagrams.revocation_version(),
        )
        self._beat_sent = now if coordinating else None
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

    def _drop(self, code: str, why: str) -> None:
        self.dropped += 1
        self.datagrams.note(code, why)  # counted by code; logged at most every few seconds per code

    def _ack(self, to: tuple[str, int], accepted: bool, code: str | None = None, message: str | None = None) -> None:
        ts = self.store.state
        self._send(Ack(self.me.cluster, self.me.node, ts.term, self.leader(), accepted, code, message), to)
