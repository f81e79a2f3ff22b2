"""The election's messaging on real loopback UDP sockets (static peers, no multicast, in one loop)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.cluster.elector import Elector, LocalNode
from agent.cluster.node_state import TermStore
from agent.common.config import Settings
from agent.protocol import Ack, Beat, DeviceOffer, decode, encode
from tests.support.udp import agreed, ask, until

GB = 1024**3


def _ports(n: int) -> list[int]:
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _node(name: str, port: int, cluster: str = "t") -> LocalNode:
    return LocalNode(name, cluster, port, "0.1.0", 16 * GB, lambda: 8 * GB, score=10.0)


@pytest.fixture
async def trio(tmp_path: Path) -> AsyncIterator[list[Elector]]:
    ports = _ports(3)
    peers = tuple(("127.0.0.1", p) for p in ports)
    electors = []
    for i, p in enumerate(ports):
        st = Settings(cluster_id="t", port=p, mdns=False, static_peers=peers)
        electors.append(Elector(_node(f"n{i}", p), st, TermStore(tmp_path / f"n{i}")))
    for e in electors:
        await e.async_start("127.0.0.1")
    yield electors
    for e in electors:
        await e.async_shutdown()


def _beat(cluster: str, node: str, term: int, role: str = "coordinator") -> bytes:
    b = Beat(cluster, node, 9, term, role, node, "available", True, 1.0, GB, 2 * GB, ("CPU",), "0.1.0")
    return encode(b)


async def test_one_coordinator_then_failover_with_a_higher_term(trio: list[Elector]) -> None:
    await until(lambda: agreed(trio) is not None)
    first = agreed(trio)
    old = next(e for e in trio if e.me.node == first)
    term = old.store.state.term
    # a crash: no goodbye, the socket just goes quiet
    assert old._task is not None and old._transport is not None
    old._task.cancel()
    old._transport.close()
    rest = [e for e in trio if e is not old]
    await until(lambda: agreed(rest) not in (None, first))
    assert all(e.store.state.term > term for e in rest)
    # each survivor admitted one coordinator per term
    for e in rest:
        seen: dict[int, str] = {}
        for h in e.history:
            assert seen.setdefault(h["term"], h["coordinator"]) == h["coordinator"]


async def test_stale_and_foreign_commands_are_refused(trio: list[Elector]) -> None:
    await until(lambda: agreed(trio) is not None)
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
    await until(lambda: agreed(trio) is not None)
    first = agreed(trio)
    coord = next(e for e in trio if e.me.node == first)
    coord.me.state = "paused"
    await until(lambda: agreed(trio) not in (None, first))
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

    await until(lambda: heard() is not None)
    b = heard()
    assert b is not None and b.mem_free == 8 * GB and b.score == 10.0
    assert b.offers == (
        DeviceOffer("CPU", 10.0, 8 * GB),
        DeviceOffer("GPU", 30.0, 8 * GB),
        DeviceOffer("GPU.1", 90.0, 3 * GB, True),
    )
    row = next(r for r in trio[1].status()["peers"] if r["node"] == "n0")
    assert [o["name"] for o in row["offers"]] == ["CPU", "GPU", "GPU.1"]
