"""Coordinator election: the decisions, as pure functions (no network, no clock of their own).

The messaging around them lives in :mod:`agent.cluster.elector`. How it works:

* Every node beats to every peer it knows (every ``beat_s``); the coordinator's beat is a
  *command* ("I coordinate term T") that each agent admits or refuses (:func:`admit`).
* Terms only grow and are persisted. An agent admits a command only from the highest term it
  has seen, and only from one coordinator per term (fencing): two coordinators can never
  both drive the same agent.
* When a node has heard no coordinator for its election delay (shorter for better-ranked
  nodes, so the best candidate usually goes first), it stands: it takes term + 1, votes for
  itself and asks the live peers. A majority of the live view elects it. Each node votes at
  most once per term, and refuses while the coordinator it follows is still alive (a node
  with a flaky link cannot depose a healthy coordinator), unless the admin pinned the
  candidate above that coordinator.
* A node that is excluded by the admin, paused, or short of memory does not stand.
* When two coordinators of one term meet (a healed partition), the one with the better
  standing stays and takes a term above both; the other steps down at once.
* A coordinator that hears of a newer term steps aside (:func:`deposed`) when that term has a
  coordinator of its own, or when it has just come back from a stall of its event loop (its
  peers counted it gone and elected, or are electing, another); only a lone challenger (a
  candidate no one follows) is fenced off by standing above its term. Without this, every
  failover after a stall turned into a fight over two or three more terms.
* A node that grants its vote restarts its own election clock, so that it does not stand
  against the candidate it just voted for before that candidate could win and beat.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from agent.common.config import Settings

EPOCH_BITS = 20


def data_term(election_term: int) -> int:
    """The data-plane term of an election term: a coordinator re-plans (after a lost node) in
    ``data_term(T) + 1``, ``+ 2`` ..., all below the next election's, so fencing holds across both."""
    return election_term << EPOCH_BITS


class Role(enum.StrEnum):
    FOLLOWER = "follower"
    CANDIDATE = "candidate"
    COORDINATOR = "coordinator"


class Action(enum.StrEnum):
    NONE = "none"
    START_ELECTION = "start_election"
    BECOME_COORDINATOR = "become_coordinator"
    GIVE_UP = "give_up"  # a candidate without a majority in time goes back to following
    STEP_DOWN = "step_down"


@dataclass(frozen=True)
class Timing:
    beat_s: float = 0.25
    peer_timeout_s: float = 1.0  # a peer not heard from for this long is gone
    election_base_s: float = 1.0
    election_spread_s: float = 0.6
    vote_window_s: float = 0.5


@dataclass(frozen=True)
class Standing:
    """What a node offers as coordinator, as it advertises it."""

    node: str
    eligible: bool
    score: float = 0.0
    mem_free: int = 0


def pin_rank(node: str, cfg: Settings) -> int:
    """How strongly the admin pins ``node`` as coordinator: 0 when not pinned, higher is stronger."""
    return len(cfg.preferred) - cfg.preferred.index(node) if node in cfg.preferred else 0


def can_stand(node: str, state: str, mem_free: int, cfg: Settings) -> str | None:
    """None when this node may stand for coordinator, else why not."""
    if node in cfg.exclude:
        return "excluded from coordinator duties by the cluster settings"
    if state == "paused":
        return "paused"
    if mem_free < cfg.min_coordinator_memory:
        need, has = cfg.min_coordinator_memory / 1024**3, mem_free / 1024**3
        return f"needs {need:.1f} GB free for coordinator duties, has {has:.1f} GB"
    return None


def order_key(s: Standing, cfg: Settings) -> tuple[bool, int, float, int, str]:
    """Sort key, larger is a better coordinator."""
    return (s.eligible, pin_rank(s.node, cfg), s.score, s.mem_free, s.node)


def conflict_key(s: Standing, cfg: Settings) -> tuple[int, float, str]:
    """Who stays when two coordinators meet: built from values both sides see alike."""
    return (pin_rank(s.node, cfg), round(s.score, 1), s.node)


def election_delay(me: Standing, peers: list[Standing], cfg: Settings, timing: Timing, u: float) -> float:
    """Seconds without a coordinator before ``me`` stands; ``u`` in [0, 1) breaks ties at random."""
    eligible = sorted((s for s in [me, *peers] if s.eligible), key=lambda s: order_key(s, cfg), reverse=True)
    rank = next((i for i, s in enumerate(eligible) if s.node == me.node), len(eligible))
    return timing.election_base_s + timing.election_spread_s * (rank + u) / max(1, len(eligible))


def quorum(view: int) -> int:
    """Votes needed out of ``view`` live nodes (the candidate included)."""
    return view // 2 + 1


@dataclass(frozen=True)
class TermState:
    """What a node persists: the highest term seen, its vote in it and the coordinator it admitted."""

    term: int = 0
    voted_for: str | None = None
    leader: str | None = None


@dataclass(frozen=True)
class Refusal:
    code: str  # stale_term | term_conflict | not_eligible | voted | leader_alive
    message: str


def admit(ts: TermState, term: int, leader: str) -> tuple[TermState, Refusal | None]:
    """A command from coordinator ``leader`` of ``term``: admitted (new state) or refused."""
    if term < ts.term:
        return ts, Refusal("stale_term", f"term {term} is older than term {ts.term}")
    if term == ts.term and ts.leader is not None and ts.leader != leader:
        return ts, Refusal("term_conflict", f"term {term} already has coordinator {ts.leader}")
    if term == ts.term:
        return TermState(term, ts.voted_for, leader), None
    return TermState(term, None, leader), None


def vote(
    ts: TermState, term: int, candidate: Standing, live_leader: str | None, cfg: Settings
) -> tuple[TermState, Refusal | None]:
    """A vote request; ``live_leader`` is the coordinator this node still hears, if any."""
    if term < ts.term:
        return ts, Refusal("stale_term", f"term {term} is older than term {ts.term}")
    if not candidate.eligible or candidate.node in cfg.exclude:
        return ts, Refusal("not_eligible", f"{candidate.node} may not coordinate")
    if term == ts.term and ts.voted_for not in (None, candidate.node):
        return ts, Refusal("voted", f"already voted for {ts.voted_for} in term {term}")
    if term == ts.term and ts.leader not in (None, candidate.node):
        return ts, Refusal("term_conflict", f"term {term} already has coordinator {ts.leader}")
    if (
        live_leader is not None
        and live_leader != candidate.node
        and pin_rank(candidate.node, cfg) <= pin_rank(live_leader, cfg)
    ):
        return ts, Refusal("leader_alive", f"coordinator {live_leader} is alive")
    return TermState(term, candidate.node, ts.leader if term == ts.term else None), None


def stand(ts: TermState, me: str, above: int = 0) -> TermState:
    """Start an election: a term above every term seen (and above ``above``), voting for itself."""
    return TermState(max(ts.term, above) + 1, me, None)


@dataclass(frozen=True)
class Situation:
    role: Role
    me: Standing
    leader: str | None  # the coordinator heard within the peer timeout, if any
    since_leader_s: float  # since the last beat of any coordinator admitted (or since start)
    election_delay_s: float
    votes: int = 0  # a candidate's granted votes, its own included
    view: int = 1  # a candidate's live view when it stood, itself included
    since_election_s: float = float("inf")  # since this node last stood


def step(sit: Situation, cfg: Settings, timing: Timing) -> Action:
    """What to do now."""
    if sit.role is Role.COORDINATOR:
        return Action.NONE if sit.me.eligible else Action.STEP_DOWN
    if sit.role is Role.CANDIDATE:
        if sit.votes >= quorum(sit.view):
            return Action.BECOME_COORDINATOR
        return Action.GIVE_UP if sit.since_election_s >= timing.vote_window_s else Action.NONE
    if not sit.me.eligible or sit.since_election_s < sit.election_delay_s:
        return Action.NONE  # (also: back off after a failed attempt)
    if sit.leader is not None:
        preempt = pin_rank(sit.me.node, cfg) > pin_rank(sit.leader, cfg)
        return Action.START_ELECTION if preempt else Action.NONE
    return Action.START_ELECTION if sit.since_leader_s >= sit.election_delay_s else Action.NONE


def deposed(term: int, my_term: int, their_leader: str | None, me: str, stalled: bool) -> bool:
    """A coordinator of ``my_term`` hears of ``term`` (from a beat or an answer that follows
    ``their_leader``): was it replaced, so that it steps aside rather than stand above?

    Replaced when that newer term has a coordinator other than this node (a majority elected
    it while this node was out of reach), or when this node has just come back from a stall
    longer than the peer timeout (``stalled``: what it hears now may be an election it missed)."""
    return term > my_term and (stalled or their_leader not in (None, me))


def yields_to(me: Standing, other: Standing, cfg: Settings) -> bool:
    """Two coordinators met: does ``me`` step down for ``other``?"""
    return conflict_key(other, cfg) > conflict_key(me, cfg)
