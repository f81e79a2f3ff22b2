"""The election's messaging on real loopback UDP sockets (static peers, no multicast, in one loop).

Elections that settle: agents started together, a coordinator whose event loop stalls, a voter
that must not stand against the candidate it just voted for. Each failover costs one term; before
these rules a coordinator back from a stall fought its successor, and three laptops went through
seven terms (each restarting the coordinator's services) before they served."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.cluster.election import Role, Timing
from agent.cluster.elector import Elector
from agent.cluster.node_state import TermStore
from agent.cluster.peers import LocalNode
from agent.common.config import Settings
from agent.protocol import Ack, Beat, DeviceOffer, Vote, VoteRequest, decode, encode
from tests.support.udp import agreed, ask, async_agreement, async_start_static, views
from tests.support.wait import async_wait_until

GB = 1024**3


def _node(name: str, cluster: str = "t") -> LocalNode:
    """A node whose elector takes a free port (0) when it starts."""
    return LocalNode(name, cluster, 0, "0.1.0", 16 * GB, lambda: 8 * GB, score=10.0)


@pytest.fixture
async def trio(tmp_path: Path) -> AsyncIterator[list[Elector]]:
    st = Settings(cluster_id="t", port=0, mdns=False)  # the static peers: once each has its port
    electors = [Elector(_node(f"n{i}"), st, TermStore(tmp_path / f"n{i}")) for i in range(3)]
    await async_start_static(electors)
    yield electors
    for e in electors:
        await e.async_stop()


def _beat(cluster: str, node: str, term: int, role: str = "coordinator") -> bytes:
    b = Beat(cluster, node, 9, term, role, node, "available", True, 1.0, GB, 2 * GB, ("CPU",), "0.1.0")
    return encode(b)


async def test_one_coordinator_then_failover_with_a_higher_term(trio: list[Elector]) -> None:
    first = await async_agreement(trio)
    old = next(e for e in trio if e.me.node == first)
    term = old.store.state.term
    # a crash: no goodbye, the socket just goes quiet
    assert old._task is not None and old._transport is not None
    old._task.cancel()
    old._transport.close()
    rest = [e for e in trio if e is not old]
    await async_agreement(rest, besides=first)
    assert all(e.store.state.term > term for e in rest)
    # each survivor admitted one coordinator per term
    for e in rest:
        seen: dict[int, str] = {}
        for h in e.history:
            assert seen.setdefault(h["term"], h["coordinator"]) == h["coordinator"]


async def test_stale_and_foreign_commands_are_refused(trio: list[Elector]) -> None:
    await async_agreement(trio)
    follower = next(e for e in trio if e.role.value == "follower")
    term = follower.store.state.term
    reply = await ask(follower.me.port, _beat("t", "usurper", term - 1))
    assert reply is not None
    ack, _ = decode(reply)
    assert isinstance(ack, Ack) and not ack.accepted and ack.code == "stale_term" and ack.term == term
    # a second coordinator in the same term is refused too
    reply = await ask(follower.me.port, _beat("t", "usurper", term))
    ack2, _ = decode(reply or b"")
    assert isinstance(ack2, Ack) and ack2.code == "term_conflict"
    # garbage, and another cluster's beats: ignored (no reply), counted, nothing changes
    dropped = follower.dropped
    assert await ask(follower.me.port, b"\x00garbage", wait=0.3) is None
    assert await ask(follower.me.port, _beat("other", "x", term + 5), wait=0.3) is None
    assert follower.dropped == dropped + 2
    assert "usurper" not in {h["coordinator"] for h in follower.history}
    assert "x" not in follower.peers and agreed(trio) is not None


async def test_a_paused_coordinator_hands_over(trio: list[Elector]) -> None:
    first = await async_agreement(trio)
    coord = next(e for e in trio if e.me.node == first)
    coord.me.state = "paused"
    await async_agreement(trio, besides=first)
    assert coord.status()["not_eligible_because"] == "paused"


async def test_beats_carry_each_devices_offer(trio: list[Elector]) -> None:
    """Shared-memory devices offer the node's fresh free memory (the figure of the beat itself);
    a discrete GPU its own figure, as the daemon last read it."""
    n0 = trio[0]
    n0.me.offers = (
        DeviceOffer("CPU", 10.0, 1 * GB),
        DeviceOffer("GPU", 30.0, 1 * GB),
        DeviceOffer("GPU.1", 90.0, 3 * GB, True),
    )

    def heard() -> Beat | None:
        p = trio[1].peers.get("n0")
        return p.beat if p is not None and p.beat is not None and p.beat.offers else None

    b = await async_wait_until(heard, 15, what="n0's beat with its offers at n1")
    assert b.mem_free == 8 * GB and b.score == 10.0
    assert b.offers == (
        DeviceOffer("CPU", 10.0, 8 * GB),
        DeviceOffer("GPU", 30.0, 8 * GB),
        DeviceOffer("GPU.1", 90.0, 3 * GB, True),
    )
    row = next(r for r in trio[1].status()["peers"] if r["node"] == "n0")
    assert [o["name"] for o in row["offers"]] == ["CPU", "GPU", "GPU.1"]


def _fenced(es: list[Elector]) -> None:
    """No elector ever admitted two coordinators in one term."""
    for e in es:
        seen: dict[int, str] = {}
        for h in e.history:
            assert seen.setdefault(h["term"], h["coordinator"]) == h["coordinator"], list(e.history)


async def test_three_agents_started_together_settle_within_two_terms(trio: list[Elector]) -> None:
    coord = await async_agreement(trio)
    # a few more beats and timeouts: nobody stands again once a coordinator is heard (a window,
    # not a wait: nothing is to happen in it)
    await asyncio.sleep(3 * trio[0].timing.peer_timeout_s)
    assert agreed(trio) == coord
    assert {e.store.state.term for e in trio} == {trio[0].store.state.term} and trio[0].store.state.term <= 2
    assert sum(e.elections for e in trio) <= 2
    assert [e.role for e in trio].count(Role.COORDINATOR) == 1
    _fenced(trio)


def _stall(e: Elector) -> None:
    """What a blocked event loop looks like from outside: no beats, datagrams pile up unread."""
    assert e._task is not None and e._transport is not None
    e._task.cancel()
    e._transport.pause_reading()


def _resume(e: Elector) -> None:
    assert e._transport is not None
    e._transport.resume_reading()
    e._task = asyncio.create_task(e._run())


async def test_a_coordinator_back_from_a_stall_follows_its_successor(trio: list[Elector]) -> None:
    first = await async_agreement(trio)
    old = next(e for e in trio if e.me.node == first)
    rest = [e for e in trio if e is not old]
    _stall(old)
    successor = await async_agreement(rest, besides=first)
    term = max(e.store.state.term for e in rest)
    _resume(old)  # it reads the election it missed (a candidate's beats and vote request) first
    await async_wait_until(
        lambda: agreed(trio) is not None and old.role is Role.FOLLOWER,
        15,
        what="the old coordinator following, all three agreed",
        diagnose=lambda: views(trio),
    )
    await asyncio.sleep(3 * old.timing.peer_timeout_s)  # a window in which a fight would show (no wait)
    assert agreed(trio) == successor  # the one elected meanwhile keeps coordinating...
    assert {e.store.state.term for e in trio} == {term}  # ...in the term it was elected in: no fight
    _fenced(trio)


async def test_a_voter_does_not_stand_against_the_candidate_it_voted_for(tmp_path: Path) -> None:
    # (a long peer timeout: the old rule restarted a voter's clock only that far back, which hid the fault)
    timing = Timing(peer_timeout_s=3.0, election_base_s=2.0, election_spread_s=0.0)
    e = Elector(_node("n0"), Settings(cluster_id="t", port=0, mdns=False), TermStore(tmp_path), timing)
    await e.async_start("127.0.0.1")
    port = e.me.port  # the free port it bound
    try:
        # the scenario's clock (not a wait): half its own election delay (2 s) gone when the request comes
        await asyncio.sleep(1.0)
        req = VoteRequest("t", "cand", 9, 1, True, 1.0, GB)
        vote, _ = decode(await ask(port, encode(req)) or b"")
        assert isinstance(vote, Vote) and vote.granted
        # the scenario's clock: the candidate counts its votes, then beats, past the voter's own delay
        await asyncio.sleep(1.4)
        beat = Beat("t", "cand", 9, 1, "coordinator", "cand", "available", True, 1.0, GB, 2 * GB, ("CPU",), "0.1.0")
        ack, _ = decode(await ask(port, encode(beat)) or b"")
        assert isinstance(ack, Ack) and ack.accepted
        assert e.elections == 0 and e.store.state.term == 1 and e.leader() == "cand"
    finally:
        await e.async_stop()
