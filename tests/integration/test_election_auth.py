"""Authenticated election traffic and identity fencing (issue 26, part 2's remaining item).

Electors with certificates of one test CA beat and vote over real loopback UDP sockets, signed
with their node keys; forged, foreign, revoked, impersonating and replayed datagrams are refused,
logged and counted while the leader and term stay as they were. Then two real agent processes
with credentials elect a coordinator, and assignments over their TLS control websocket from a
member that is not the coordinator, or of an older term, are refused with the node unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from agent.cluster.election import Role, TermState, Timing, data_term
from agent.cluster.elector import Elector, LocalNode
from agent.cluster.fencing import CoordinatorFence
from agent.cluster.node_state import TermStore
from agent.common.config import Settings
from agent.protocol import (
    Assign,
    Beat,
    DeviceOffer,
    Error,
    Message,
    ProtocolError,
    Sealed,
    Vote,
    VoteRequest,
    decode,
    encode,
)
from agent.security import cluster, files
from agent.security.credentials import Credentials
from agent.security.datagrams import Plain, Receiver, Signed, sealed
from agent.security.transport import Transport
from coordinator.lab.local_cluster import LocalCluster, free_port
from tests.support.members import Home, make_member
from tests.support.udp import agreed, async_agreement, async_start_static
from tests.support.udp import ask as _ask_udp
from tests.support.wait import async_wait_until, wait_until


async def send(port: int, frame: bytes, wait: float = 0.4) -> bytes | None:
    return await _ask_udp(port, frame, wait)


GB = 1024**3
FAST = Timing(beat_s=0.1, peer_timeout_s=0.6, election_base_s=0.5, election_spread_s=0.3, vote_window_s=0.4)
NODES = ("a1a1a1a1a1a1", "b2b2b2b2b2b2", "c3c3c3c3c3c3")


@dataclass
class Pki:
    ca: Path  # the CA holder's folder
    members: list[Credentials]  # the electors, NODES in order (the first holds the CA)
    impostor: Credentials  # a member of this cluster that takes no part in the election
    revoked: Credentials  # a member of this cluster, revoked
    outsider: Credentials  # a member of another cluster

    @property
    def cluster(self) -> str:
        return self.members[0].cluster_id


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca = files.security_dir(root / NODES[0])
    members = [cluster.init_cluster(NODES[0], ca)]
    members += [make_member(ca, files.security_dir(root / n), n) for n in NODES[1:]]
    impostor = make_member(ca, files.security_dir(root / "imp"), "d4d4d4d4d4d4")
    revoked = make_member(ca, files.security_dir(root / "rev"), "e5e5e5e5e5e5")
    cluster.revoke(revoked.node_id, ca)
    rl = Credentials.load(ca).revoked
    assert rl is not None
    for m in members:  # the members learn the new list (as gossip or 'cluster join' would hand it)
        m.adopt(rl)
    outsider = cluster.init_cluster("f6f6f6f6f6f6", files.security_dir(root / "out"))
    return Pki(ca, members, impostor, revoked, outsider)


@dataclass
class Trio:
    electors: list[Elector]
    tapped: list[bytes]  # every datagram the electors sent to the tap (a silent static peer)


@pytest.fixture
async def trio(pki: Pki, tmp_path: Path) -> AsyncIterator[Trio]:
    tapped: list[bytes] = []
    loop = asyncio.get_running_loop()
    tap, _ = await loop.create_datagram_endpoint(  # a static peer that records, never answers
        lambda: Receiver(lambda data, src: tapped.append(data)), local_addr=("127.0.0.1", 0)
    )
    electors = []
    for creds in pki.members:
        st = Settings(cluster_id=pki.cluster, port=0, mdns=False)
        me = LocalNode(creds.node_id, pki.cluster, 0, "0.1.0", 16 * GB, lambda: 8 * GB, score=10.0)
        electors.append(Elector(me, st, TermStore(tmp_path / creds.node_id), FAST, Signed(creds)))
    await async_start_static(electors, also=(("127.0.0.1", tap.get_extra_info("sockname")[1]),))
    yield Trio(electors, tapped)
    for e in electors:
        await e.async_stop()
    tap.close()


def _beat(cluster: str, node: str, term: int, role: str = "coordinator", offers: int = 1) -> Beat:
    devs = tuple(DeviceOffer(f"GPU.{i}", 1234.5, 8 * GB, True) for i in range(offers))
    return Beat(cluster, node, 9, term, role, node, "available", True, 1.0, GB, 2 * GB, ("CPU",), "0.1.0", offers=devs)


def _now_us() -> int:
    return time.time_ns() // 1000


def _seal(creds: Credentials, msg: Message, *, stamp: int | None = None, node: str | None = None) -> bytes:
    return encode(sealed(creds, msg, _now_us() if stamp is None else stamp, node=node))


def _opened(frame: bytes) -> tuple[Sealed, Message]:
    env, _ = decode(frame)
    assert isinstance(env, Sealed)
    inner, _ = decode(env.body)
    return env, inner


async def test_signed_trio_elects_one_coordinator(trio: Trio) -> None:
    es = trio.electors
    leader = await async_agreement(es)
    assert sum(e.role is Role.COORDINATOR for e in es) == 1
    # steady traffic: every elector sends 20 lean datagrams (about a second of beats to its two peers)
    await async_wait_until(
        lambda: [e.status()["election_traffic"]["sent"]["lean"]["datagrams"] for e in es],
        15,
        what="a second of beats from every elector",
        ok=lambda sent: min(sent) >= 20,
    )
    # every datagram on the wire is signed (the tap, never heard from, gets the certificate each time)
    assert trio.tapped and all(_opened(f)[0].cluster == es[0].me.cluster for f in trio.tapped)
    for e in es:
        st = e.status()["election_traffic"]
        assert st["mode"] == "signed" and set(st["refused"]) <= {"unknown_cert"}, st
        assert e.store.state.leader == leader
        # to the peers that know it, the certificate travels in one datagram of CERT_EVERY
        sent, to_tap = st["sent"], sum(1 for f in trio.tapped if _opened(f)[0].node == e.me.node)
        assert sent["lean"]["datagrams"] > sent["with_cert"]["datagrams"] - to_tap, (sent, to_tap)
        assert sent["with_cert"]["largest_bytes"] < 1100 and sent["lean"]["largest_bytes"] < 600, sent


def test_datagram_sizes(pki: Pki) -> None:
    """The largest beat (8 device offers, a long host name) with the certificate fits one datagram."""
    m = pki.members[0]
    big = replace(_beat(pki.cluster, m.node_id, 7, offers=8), name="x" * 64, reason="y" * 40)
    env = sealed(m, big, _now_us())
    full, lean = encode(env), encode(replace(env, cert=None))
    assert len(full) < 1400 and len(lean) < 900, (len(full), len(lean))
    assert len(m.node_cert_der) < len(full) - len(lean) <= len(m.node_cert_der) + 3  # the DER and its bin header


async def test_forged_foreign_revoked_impersonating_and_replayed_refused(
    trio: Trio, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    es = trio.electors
    leader = await async_agreement(es)
    follower = next(e for e in es if e.role is Role.FOLLOWER)
    term, cid = follower.store.state.term, pki.cluster
    recorded = next(
        f for f in trio.tapped if (x := _opened(f))[0].node == leader and isinstance(x[1], Beat) and x[1].term == term
    )
    imp = pki.impostor
    cases: list[tuple[str, str, bytes]] = [
        ("an unsigned beat of a higher term", "unsigned", encode(_beat(cid, "usurper", term + 5))),
        (
            "a vote signed by another cluster's CA",
            "other_ca",
            _seal(pki.outsider, Vote(cid, imp.node_id, term, term, True)),
        ),
        (
            "a vote request signed by another cluster's CA",
            "other_ca",
            _seal(pki.outsider, VoteRequest(cid, pki.outsider.node_id, 9, term + 5, True, 99.0, GB)),
        ),
        ("a revoked node's beat", "revoked", _seal(pki.revoked, _beat(cid, pki.revoked.node_id, term + 5))),
        ("a beat claiming the leader's id", "wrong_node", _seal(imp, _beat(cid, leader or "", term + 5), node=leader)),
        ("a signed beat speaking for the leader", "wrong_node", _seal(imp, _beat(cid, leader or "", term + 5))),
        ("another cluster's envelope", "other_cluster", _seal(pki.outsider, _beat(pki.outsider.cluster_id, "x", 9))),
        ("the leader's beat, replayed", "replay", recorded),
        (
            "a member's vote sealed for the leader",
            "wrong_recipient",
            encode(sealed(imp, Vote(cid, imp.node_id, term, term, True), _now_us(), to=leader)),
        ),
        (
            "a beat stamped two minutes ago",
            "stale",
            _seal(imp, _beat(cid, imp.node_id, term + 5), stamp=_now_us() - 120_000_000),
        ),
    ]
    # a bad signature: a valid envelope whose body was swapped after signing
    env = sealed(imp, _beat(cid, imp.node_id, term, "follower"), _now_us())
    forged = replace(env, body=encode(_beat(cid, imp.node_id, term + 5)))
    cases.append(("a tampered body", "bad_signature", encode(forged)))
    caplog.set_level(logging.INFO, logger="agent.security.datagrams")
    for what, code, frame in cases:
        before = follower.datagrams.refused[code]
        assert await send(follower.me.port, frame) is None, what  # no answer to a refused datagram
        await async_wait_until(
            lambda c=code: follower.datagrams.refused[c],  # type: ignore[misc]
            2,
            what=f"{what} counted as refused ({code})",
            ok=lambda n, b=before: n > b,  # type: ignore[misc]
        )
        assert any(f"[{code}," in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records), what
        assert follower.store.state.term == term and agreed(es) == leader, what
    assert not {"usurper", pki.revoked.node_id, pki.outsider.node_id} & set(follower.peers)
    assert {h["coordinator"] for h in follower.history} == {leader}
    # a valid datagram of a member is taken once; the same bytes again, or an older term after, are not
    ok = _seal(imp, _beat(cid, imp.node_id, term, "follower"))
    await send(follower.me.port, ok)
    await async_wait_until(lambda: imp.node_id in follower.peers, 2, what="the member's valid beat taken")
    await send(follower.me.port, ok)
    await send(follower.me.port, _seal(imp, _beat(cid, imp.node_id, term - 1, "follower")))
    await async_wait_until(
        lambda: follower.datagrams.refused["stale_term"], 2, what="the older term refused", ok=lambda n: n == 1
    )
    assert follower.datagrams.refused["replay"] == 2
    st = follower.status()
    assert st["election_traffic"]["refused"]["unsigned"] == 1 and st["datagrams_ignored"] >= len(cases) + 2


async def test_old_term_beat_replayed_after_failover(trio: Trio) -> None:
    es = trio.electors
    first = await async_agreement(es)
    old = next(e for e in es if e.me.node == first)
    term = old.store.state.term
    recorded = [f for f in trio.tapped if (x := _opened(f))[0].node == first and isinstance(x[1], Beat)]
    assert old._task is not None and old._transport is not None
    old._task.cancel()  # a crash: the socket goes quiet
    old._transport.close()
    rest = [e for e in es if e is not old]
    await async_agreement(rest, besides=first)
    now = {e.me.node: (e.store.state.term, e.leader()) for e in rest}
    assert all(t > term for t, _ in now.values())
    for e in rest:
        await send(e.me.port, recorded[-1])  # the old coordinator's last beat, of an older term
        await async_wait_until(
            lambda e=e: e.datagrams.refused["replay"],  # type: ignore[misc]
            2,
            what=f"the replay refused by {e.me.node}",
            ok=lambda n: n >= 1,
        )
    await asyncio.sleep(0.3)  # a window, not a wait: a replay taken would move a term or a leader in it
    assert {e.me.node: (e.store.state.term, e.leader()) for e in rest} == now


async def test_plaintext_and_signed_nodes_ignore_each_other(pki: Pki, tmp_path: Path) -> None:
    """A node without credentials and a member, each the other's static peer: neither hears the
    other (each coordinates alone), and each counts the other's datagrams as refused."""
    m = pki.members[1]
    st = Settings(cluster_id=pki.cluster, port=0, mdns=False)  # the static peers: once each has its port
    plain = Elector(
        LocalNode("plainnode", pki.cluster, 0, "0.1.0", 16 * GB, lambda: 8 * GB),
        st,
        TermStore(tmp_path / "plain"),
        FAST,
    )
    secure = Elector(
        LocalNode(m.node_id, pki.cluster, 0, "0.1.0", 16 * GB, lambda: 8 * GB),
        st,
        TermStore(tmp_path / "secure"),
        FAST,
        Signed(m),
    )
    assert isinstance(plain.datagrams, Plain)
    await async_start_static([plain, secure])
    try:
        await async_wait_until(
            lambda: (plain.leader(), secure.leader()),
            15,
            what="each coordinating alone",
            ok=lambda v: v == ("plainnode", m.node_id),
        )
        await async_wait_until(
            lambda: (plain.datagrams.refused["signed"], secure.datagrams.refused["unsigned"]),
            15,
            what="each to refuse the other's datagrams",
            ok=lambda counts: min(counts) > 0,
        )
        assert not plain.peers and not secure.peers
        assert {h["coordinator"] for h in plain.history} == {"plainnode"}
        assert {h["coordinator"] for h in secure.history} == {m.node_id}
        assert plain.status()["election_traffic"]["mode"] == "plaintext"
    finally:
        for e in (plain, secure):
            await e.async_stop()


@pytest.mark.parametrize(
    ("state", "term", "peer", "code"),
    [
        (TermState(3, None, "aaa"), 3, "aaa", None),  # the coordinator of the term
        (TermState(3, None, "aaa"), 3, "bbb", "not_coordinator"),  # a member, not the coordinator
        (TermState(3, None, "aaa"), 3, None, "not_coordinator"),  # no certificate on the link
        (TermState(3, None, "aaa"), 2, "aaa", "stale_term"),  # a command of an older term, replayed
        (TermState(3, None, "aaa"), 4, "aaa", "unknown_term"),  # a term this node never admitted
        (TermState(3, "bbb", None), 3, "bbb", "not_coordinator"),  # voted for, but no coordinator admitted
    ],
)
async def test_fence_table(state: TermState, term: int, peer: str | None, code: str | None) -> None:
    fence = CoordinatorFence(lambda: state, wait_s=0.2)
    if code is None:
        await fence.async_check(data_term(term) + 2, peer)  # a re-plan in the same election term
        assert fence.refused == 0
        return
    with pytest.raises(ProtocolError) as e:
        await fence.async_check(data_term(term), peer)
    assert e.value.code == code and fence.refused == 1


async def test_fence_waits_for_the_election_to_admit_a_new_term() -> None:
    state = TermState(3, None, "aaa")
    fence = CoordinatorFence(lambda: state, wait_s=3.0)
    check = asyncio.ensure_future(fence.async_check(data_term(4), "bbb"))
    await asyncio.sleep(0.2)  # a window, not a wait: no beat of term 4 yet, so the check must still be held
    assert not check.done()
    state = TermState(4, "bbb", "bbb")  # its first beat arrives
    await asyncio.wait_for(check, 2)


# -- real agent processes ----------------------------------------------------------------------
def _get(api_port: int, path: str) -> dict[str, object]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{api_port}{path}", timeout=5) as r:
            return dict(json.loads(r.read()))
    except (OSError, ValueError):
        return {}


def _assign(term: int) -> Assign:
    return Assign(
        term=term,
        export_id="forged",
        stage=0,
        stages=1,
        manifest_sha256="0" * 64,
        artifacts_url="https://127.0.0.1:1/artifacts/forged",
        local_dir=None,
        next_hop="wss://127.0.0.1:1/ring",
    )


async def _assign_over_tls(creds: Credentials, port: int, msg: Assign) -> Message:
    """Send ``msg`` on the agent's control websocket as the node ``creds`` name; its answer."""
    t = Transport(creds)
    async with t.session() as s, s.ws_connect(t.url(f"127.0.0.1:{port}", "/ws", ws=True)) as ws:
        await ws.send_bytes(encode(msg))
        m = await ws.receive(timeout=60)
        answer, _ = decode(m.data)
        return answer


def test_assignments_only_from_the_elected_coordinator(pki: Pki, tmp_path: Path) -> None:
    # (ports picked before the agents bind them: each is the other's static peer, and a port's node
    # id, which its certificate names, comes before the process; LocalCluster needs them known)
    homes = [Home(tmp_path / h, free_port()) for h in ("x", "y")]
    creds = []
    for h in homes:
        creds.append(make_member(pki.ca, files.security_dir(h.security), h.node()))
    envs = [{**h.env, "LAKESHARD_SHARED_CACHE": str(tmp_path / "cache")} for h in homes]
    with LocalCluster(2, elect=["--device", "CPU"], agent_envs=envs, ports=[h.port for h in homes], secure=True) as c:
        views = wait_until(
            lambda: [_get(p, "/v1/cluster") for p in c.api_ports],
            60,
            what="both agents to follow one coordinator",
            ok=lambda vs: len({v.get("coordinator") for v in vs}) == 1 and vs[0].get("coordinator") is not None,
            step=0.3,
        )
        leader = views[0]["coordinator"]
        for v in views:  # signed beats between the two, none refused but while certificates were learnt
            traffic = v["election_traffic"]
            assert traffic["mode"] == "signed" and set(traffic["refused"]) <= {"unknown_cert"}, v  # type: ignore[index]
        lead = next(i for i, h in enumerate(homes) if h.node() == leader)
        other = 1 - lead
        term = int(views[other]["term"])  # type: ignore[call-overload]
        before = _get(c.api_ports[other], "/v1/node")["stage"]

        async def attempts() -> list[Message]:
            return [
                # a member of the cluster that is not the coordinator, in the current term
                await _assign_over_tls(pki.impostor, homes[other].port, _assign(data_term(term))),
                # the follower asks the coordinator's own agent
                await _assign_over_tls(creds[other], homes[lead].port, _assign(data_term(term))),
                # the coordinator itself, an assignment of an older term (replayed)
                await _assign_over_tls(creds[lead], homes[other].port, _assign(data_term(term - 1) + 3)),
                # the coordinator, its own term: past the fence (the forged stage files then fail)
                await _assign_over_tls(creds[lead], homes[other].port, _assign(data_term(term))),
            ]

        got = asyncio.run(attempts())
        codes = [a.code if isinstance(a, Error) else a.TYPE for a in got]
        assert codes[:3] == ["not_coordinator", "not_coordinator", "stale_term"], got
        assert codes[3] == "bad_artifact", got
        after = _get(c.api_ports[other], "/v1/node")["stage"]
        keep = ("term_seen", "assigned", "stage", "streams")
        assert {k: after[k] for k in keep} == {k: before[k] for k in keep}, (before, after)  # type: ignore[index]
        view = _get(c.api_ports[other], "/v1/cluster")
        assert view["term"] == term and view["coordinator"] == leader and view["assignments_refused"] == 2, view
