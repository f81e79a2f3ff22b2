"""The election's pure decisions, table-driven, and the persisted term (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.cluster.election import (
    Action,
    Role,
    Situation,
    Standing,
    TermState,
    Timing,
    admit,
    can_stand,
    deposed,
    election_delay,
    quorum,
    stand,
    step,
    vote,
    yields_to,
)
from agent.cluster.node_state import StateError, TermStore, node_id
from agent.common.config import ConfigError, Settings, load, parse

GB = 1024**3
CFG = Settings(preferred=("boss",), exclude=frozenset({"flaky"}), min_coordinator_memory=2 * GB)
T = Timing()


@pytest.mark.parametrize(
    ("node", "state", "mem", "why"),
    [
        ("a", "available", 8 * GB, None),
        ("a", "limited", 8 * GB, None),
        ("a", "paused", 8 * GB, "paused"),
        ("flaky", "available", 8 * GB, "excluded"),
        ("a", "available", GB, "needs 2.0 GB free"),
    ],
)
def test_who_may_stand(node: str, state: str, mem: int, why: str | None) -> None:
    got = can_stand(node, state, mem, CFG)
    assert (got is None) if why is None else (got is not None and why in got)


@pytest.mark.parametrize(
    ("ts", "term", "leader", "accepted", "code", "after"),
    [
        (TermState(3, None, None), 3, "x", True, None, TermState(3, None, "x")),
        (TermState(3, "y", "x"), 3, "x", True, None, TermState(3, "y", "x")),
        (TermState(3, "y", "x"), 4, "z", True, None, TermState(4, None, "z")),
        (TermState(3, None, "x"), 2, "x", False, "stale_term", TermState(3, None, "x")),
        (TermState(3, None, "x"), 3, "z", False, "term_conflict", TermState(3, None, "x")),
    ],
)
def test_fencing(ts: TermState, term: int, leader: str, accepted: bool, code: str | None, after: TermState) -> None:
    new, refusal = admit(ts, term, leader)
    assert (refusal is None) == accepted
    assert (refusal.code if refusal else None) == code
    assert new == after


def _cand(node: str = "c", eligible: bool = True) -> Standing:
    return Standing(node, eligible, 10.0, 8 * GB)


@pytest.mark.parametrize(
    ("ts", "term", "cand", "live", "code"),
    [
        (TermState(1, None, "x"), 2, _cand(), None, None),
        (TermState(2, None, None), 1, _cand(), None, "stale_term"),
        (TermState(2, "d", None), 2, _cand(), None, "voted"),
        (TermState(2, "c", None), 2, _cand(), None, None),  # a repeated request
        (TermState(2, None, "x"), 2, _cand(), None, "term_conflict"),
        (TermState(1, None, "x"), 2, _cand(), "x", "leader_alive"),  # a flaky node cannot depose
        (TermState(1, None, "x"), 2, _cand("boss"), "x", None),  # the admin's pin can
        (TermState(1, None, "boss"), 2, _cand(), "boss", "leader_alive"),
        (TermState(1, None, "x"), 2, _cand("x"), "x", None),  # the coordinator re-fencing itself
        (TermState(1, None, None), 2, _cand(eligible=False), None, "not_eligible"),
        (TermState(1, None, None), 2, _cand("flaky"), None, "not_eligible"),
    ],
)
def test_votes(ts: TermState, term: int, cand: Standing, live: str | None, code: str | None) -> None:
    new, refusal = vote(ts, term, cand, live, CFG)
    assert (refusal.code if refusal else None) == code
    if code is None:
        assert new.term == term and new.voted_for == cand.node
    else:
        assert new == ts


def test_one_vote_per_term() -> None:
    ts, r1 = vote(TermState(1), 2, _cand("a"), None, CFG)
    _, r2 = vote(ts, 2, _cand("b"), None, CFG)
    assert r1 is None and r2 is not None and r2.code == "voted"


def test_standing_takes_a_higher_term() -> None:
    assert stand(TermState(4, "x", "x"), "me") == TermState(5, "me", None)
    assert stand(TermState(4), "me", above=9) == TermState(10, "me", None)


@pytest.mark.parametrize(("view", "need"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3)])
def test_quorum(view: int, need: int) -> None:
    assert quorum(view) == need


def _sit(**kw: object) -> Situation:
    base: dict[str, object] = {
        "role": Role.FOLLOWER,
        "me": Standing("me", True, 5.0, 8 * GB),
        "leader": None,
        "since_leader_s": 0.0,
        "election_delay_s": 1.2,
    }
    base.update(kw)
    return Situation(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sit", "action"),
    [
        (_sit(leader="x", since_leader_s=0.1), Action.NONE),
        (_sit(since_leader_s=0.5), Action.NONE),
        (_sit(since_leader_s=1.3), Action.START_ELECTION),
        (_sit(since_leader_s=1.3, since_election_s=0.5), Action.NONE),  # backs off after a failed try
        (_sit(since_leader_s=9.0, me=Standing("me", False)), Action.NONE),  # paused or excluded
        (_sit(leader="x", me=Standing("boss", True)), Action.START_ELECTION),  # the pinned node takes over
        (_sit(leader="boss", me=Standing("boss2", True)), Action.NONE),
        (_sit(role=Role.CANDIDATE, votes=3, view=4), Action.BECOME_COORDINATOR),
        (_sit(role=Role.CANDIDATE, votes=2, view=4, since_election_s=0.1), Action.NONE),
        (_sit(role=Role.CANDIDATE, votes=2, view=4, since_election_s=0.6), Action.GIVE_UP),
        (_sit(role=Role.CANDIDATE, votes=1, view=1), Action.BECOME_COORDINATOR),  # alone
        (_sit(role=Role.COORDINATOR), Action.NONE),
        (_sit(role=Role.COORDINATOR, me=Standing("me", False)), Action.STEP_DOWN),
    ],
)
def test_step(sit: Situation, action: Action) -> None:
    assert step(sit, CFG, T) is action


def test_better_nodes_stand_first() -> None:
    fast, slow = Standing("f", True, 100.0, 8 * GB), Standing("s", True, 10.0, 8 * GB)
    paused = Standing("p", False, 500.0, 8 * GB)
    for u in (0.0, 0.5, 0.99):
        d_fast = election_delay(fast, [slow, paused], CFG, T, u)
        d_slow = election_delay(slow, [fast, paused], CFG, T, 0.0)
        assert T.election_base_s <= d_fast < d_slow <= T.election_base_s + T.election_spread_s
    assert election_delay(Standing("boss", True, 1.0), [fast, slow], CFG, T, 0.0) == T.election_base_s


def test_meeting_coordinators_agree_who_stays() -> None:
    a, b, boss = Standing("a", True, 50.0), Standing("b", True, 50.0), Standing("boss", True, 1.0)
    assert yields_to(a, b, CFG) != yields_to(b, a, CFG)
    assert yields_to(a, boss, CFG) and not yields_to(boss, a, CFG)


def test_term_store_survives_restarts(tmp_path: Path) -> None:
    s = TermStore(tmp_path)
    assert s.state == TermState()
    s.save(TermState(7, "me", "me"))
    assert TermStore(tmp_path).state == TermState(7, "me", "me")
    with pytest.raises(ValueError, match="may not go back"):
        s.save(TermState(6))
    (tmp_path / "term.json").write_text("{not json")
    with pytest.raises(StateError, match="corrupt"):
        TermStore(tmp_path)


def test_node_id_is_stable(tmp_path: Path) -> None:
    a = node_id(tmp_path)
    assert a == node_id(tmp_path) and len(a) == 12


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({"cluster_id": "bad id!"}, "cluster_id"),
        ({"port": 70000}, "port"),
        ({"discovery": {"static_peers": ["nohost"]}}, "static_peers"),
        ({"discovery": {"mdns": "yes"}}, "discovery.mdns"),
        ({"election": {"exclude": "abc"}}, "election.exclude"),
        ({"election": {"min_coordinator_memory_gb": -1}}, "min_coordinator_memory_gb"),
        ({"colour": "blue"}, "unknown setting"),
        ({"serve": {"ring_port": 70000}}, "ring_port"),
        ({"serve": {"ring_port": "7702"}}, "ring_port"),
        ({"serve": {"min_nodes": 0}}, "serve.min_nodes"),
        ({"serve": {"min_nodes": "all"}}, "serve.min_nodes"),
        ({"serve": {"attention": "pagd"}}, "serve.attention"),
        (["a", "list"], "mapping"),
    ],
)
def test_bad_settings_are_named(data: object, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        parse(data)


def test_the_coordinator_ring_port_is_fixed_unless_set() -> None:
    from agent.common.config import ring_port_for

    assert parse({}).serve_ring_port is None and ring_port_for(7700) == 7702  # the default: port + 2
    assert parse({"serve": {"ring_port": 9000}}).serve_ring_port == 9000
    assert parse({"serve": {"ring_port": 0}}).serve_ring_port == 0  # any free port
    assert ring_port_for(65535) == 0 and ring_port_for(0) == 0


def test_the_attention_setting_is_the_option_else_the_environment_else_the_file_else_auto() -> None:
    from agent.common.config import attention_setting

    filed = parse({"serve": {"attention": "stateful"}})
    assert attention_setting(None, parse({}), env={}) == "auto"  # the default: paged where the device runs it
    assert attention_setting(None, filed, env={}) == "stateful"
    assert attention_setting(None, filed, env={"LAKESHARD_ATTENTION": "Paged"}) == "paged"
    assert attention_setting("stateful", filed, env={"LAKESHARD_ATTENTION": "paged"}) == "stateful"
    with pytest.raises(ConfigError, match="LAKESHARD_ATTENTION must be one of auto, paged, stateful, not 'fast'"):
        attention_setting(None, filed, env={"LAKESHARD_ATTENTION": "fast"})


def test_settings_file(tmp_path: Path) -> None:
    f = tmp_path / "config.yaml"
    f.write_text(
        "cluster_id: office-3\ndiscovery:\n  static_peers: ['10.0.0.2:7700']\n"
        "election:\n  preferred: [boss]\n  min_coordinator_memory_gb: 0.5\n"
    )
    s = load(f)
    assert (s.cluster_id, s.static_peers, s.preferred) == ("office-3", (("10.0.0.2", 7700),), ("boss",))
    assert s.min_coordinator_memory == GB // 2
    f.write_text("cluster_id: [unclosed")
    with pytest.raises(ConfigError, match="cannot read"):
        load(f)


@pytest.mark.parametrize(
    ("term", "their_leader", "stalled", "steps_aside"),
    [
        (6, "z", False, True),  # a newer term with a coordinator of its own: elected while we were away
        (6, None, False, False),  # a lone candidate's newer term: fenced off (we stand above it)
        (6, "me", False, False),  # it still follows us
        (6, None, True, True),  # just back from a stall: what we hear may be an election we missed
        (5, "z", True, False),  # our own term: the standing decides (two coordinators of one term)
        (4, "z", False, False),  # an older term: nothing to yield to
    ],
)
def test_a_coordinator_steps_aside_for_a_successor_not_for_a_challenger(
    term: int, their_leader: str | None, stalled: bool, steps_aside: bool
) -> None:
    assert deposed(term, 5, their_leader, "me", stalled) is steps_aside
