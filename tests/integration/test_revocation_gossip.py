"""Revocation gossip (issue 26): a node revoked on the CA holder is refused by every member.

Three secure elected agents on loopback (a throwaway cluster made through their local APIs);
agent 0 holds the CA and revokes agent 2. Agent 1, to which nobody copies anything, learns the
new list from agent 0's beats, adopts it and refuses agent 2: its TLS requests, the websocket
it had open, and its signed beats. And a list that fails the check never replaces the one held,
whatever version a beat announces.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.cluster.revocation_gossip import RevocationGossip
from agent.protocol import Beat
from agent.security import cluster, files, revocation
from agent.security.credentials import Credentials
from agent.security.errors import SecurityError
from agent.security.transport import Transport
from coordinator.lab.local_cluster import LocalCluster
from tests.support.members import exchange, make_member
from tests.support.wait import async_wait_until


async def _local(s: aiohttp.ClientSession, port: int, path: str, body: dict[str, Any] | None = None) -> Any:
    url = f"http://127.0.0.1:{port}{path}"
    if body is None:
        async with s.get(url) as r:
            return await r.json()
    async with s.post(url, data=json.dumps(body), headers={"Content-Type": "application/json"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _peer(s: aiohttp.ClientSession, port: int, node: str) -> dict[str, Any] | None:
    st = await _local(s, port, "/v1/cluster")
    return next((p for p in st["peers"] if p["node"] == node), None)


def test_a_revocation_reaches_every_member() -> None:
    with LocalCluster(3, elect=[], secure=True, form=True) as c:
        n0, n2, version = asyncio.run(_revoke_and_watch(c))
        # the agent's own log file (its home's logs/; the console shows warnings only)
        log1 = "".join(p.read_text(errors="replace") for p in (c.home(1) / "logs").glob("*.log"))
    assert f"revocation list v{version} from node {n0}: revoked {n2}" in log1, log1[-3000:]
    assert f"node {n2} is revoked: closed its open connections" in log1, log1[-3000:]


async def _revoke_and_watch(c: LocalCluster) -> tuple[str, str, int]:
    a0, a1, _ = c.api_ports
    async with aiohttp.ClientSession() as s:
        ids = [await _local(s, p, "/v1/cluster/identity") for p in c.api_ports]
        n0, n1, n2 = (str(i["node_id"]) for i in ids)
        before = int(ids[1]["revocation_version"])

        async def alive(port: int, node: str) -> bool:
            p = await _peer(s, port, node)
            return bool(p and p["alive"])

        for port, node in ((a1, n0), (a1, n2), (a0, n1)):
            await async_wait_until(
                lambda p=port, n=node: _peer(s, p, n),  # type: ignore[misc]
                20,
                what=f"{node} alive at agent on {port}",
                ok=lambda row: row is not None and row["alive"],
                step=0.25,
            )
        creds2 = Credentials.load(c.home(2) / "config" / "security")
        assert creds2.node_id == n2
        ctx2 = creds2.client_ssl_context()
        got = await asyncio.to_thread(exchange, c.ports[1], ctx2)
        assert isinstance(got, bytes) and got.startswith(b"HTTP/1.1 200"), got
        # agent 2 holds a websocket open on agent 1's data port
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx2)) as s2:
            ws = await s2.ws_connect(f"wss://127.0.0.1:{c.ports[1]}/ws")
            await asyncio.sleep(0.5)  # a window, not a wait: a member's link stays open (a refused one closes)
            assert not ws.closed

            t0 = time.monotonic()
            answer = await _local(s, a0, "/v1/cluster/revoke", {"node": n2})
            version = int(answer["version"])
            assert version == before + 1 and not answer["already"], answer

            ident = await async_wait_until(
                lambda: _local(s, a1, "/v1/cluster/identity"),
                10,
                what="agent 1 to adopt the new list",
                ok=lambda i: i["revocation_version"] == version,
                step=0.25,
            )
            took = time.monotonic() - t0
            assert n2 in ident["revoked"], ident
            # the websocket agent 2 had open is closed
            msg = await asyncio.wait_for(ws.receive(), 10)
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR), msg
        # a new request of agent 2 is refused: 403, or no handshake at all
        got = await asyncio.to_thread(exchange, c.ports[1], ctx2)
        refused = not isinstance(got, bytes) or got == b"" or got.startswith(b"HTTP/1.1 403")
        assert refused, got
        # its signed beats are refused as revoked: it drops out of agent 1's live peers
        await async_wait_until(
            lambda: _peer(s, a1, n2),
            10,
            what="agent 2 to be no longer a live peer of agent 1",
            ok=lambda row: row is None or not row["alive"],
            step=0.25,
        )
        st = await _local(s, a1, "/v1/cluster")
        assert st["election_traffic"]["refused"].get("revoked", 0) > 0, st["election_traffic"]
        assert st["revocation"]["adopted"] == 1 and st["revocation"]["version"] == version, st["revocation"]
        assert await alive(a1, n0) and await alive(a0, n1)  # the rest of the cluster carries on
    print(f"agent 1 adopted revocation list v{version} {took:.1f} s after the revoke on agent 0")
    return n0, n2, version


# -- lists that fail the check never replace the one held ---------------------------------------


def _beat(node: str, port: int, revocation_version: int) -> Beat:
    return Beat(
        "c",
        node,
        port,
        1,
        "follower",
        None,
        "available",
        True,
        1.0,
        1,
        2,
        ("CPU",),
        "0.1.0",
        revocation=revocation_version,
    )


@pytest.fixture
def members(tmp_path: Path) -> tuple[Path, Credentials, Credentials, Credentials]:
    ca_dir = files.security_dir(tmp_path / "ca")
    cluster.init_cluster("0a0a0a0a0a0a", ca_dir)
    me = make_member(ca_dir, files.security_dir(tmp_path / "me"), "0b0b0b0b0b0b")
    peer = make_member(ca_dir, files.security_dir(tmp_path / "peer"), "0c0c0c0c0c0c")
    outsider = cluster.init_cluster("0d0d0d0d0d0d", files.security_dir(tmp_path / "outsider"))
    return ca_dir, me, peer, outsider


def _forged(ca_dir: Path, outsider: Credentials) -> dict[str, bytes]:
    ca = Credentials.load(ca_dir)
    assert ca.ca_key is not None and outsider.ca_key is not None
    v0 = ca.revoked or revocation.empty(ca.ca_key, ca.ca_cert)
    v1 = revocation.add(v0, ca.ca_key, ca.ca_cert, "0c0c0c0c0c0c")
    bumped = dict(v1.to_json(), version=9)  # a higher version, the signature of v1
    swapped = dict(v1.to_json(), entries=[{"node": "0b0b0b0b0b0b", "at": 1}])  # revokes someone else
    theirs = revocation.add(
        revocation.empty(outsider.ca_key, outsider.ca_cert), outsider.ca_key, outsider.ca_cert, "0c0c0c0c0c0c"
    )
    as_ours = dict(revocation.signed(outsider.ca_key, outsider.ca_cert, 9, ()).to_json(), cluster=ca.cluster_id)
    return {
        "version bumped, signature kept": json.dumps(bumped).encode(),
        "entries changed, signature kept": json.dumps(swapped).encode(),
        "another cluster's list": json.dumps(theirs.to_json()).encode(),
        "another CA's signature, our cluster id": json.dumps(as_ours).encode(),
        "not JSON": b"\x00revoked",
        "too large": b" " * (revocation.MAX_BYTES + 1),
        "the list held, announced as v9": json.dumps(v0.to_json()).encode(),
    }


@pytest.mark.parametrize(
    "case",
    [
        "version bumped, signature kept",
        "entries changed, signature kept",
        "another cluster's list",
        "another CA's signature, our cluster id",
        "not JSON",
        "too large",
        "the list held, announced as v9",
    ],
)
def test_a_bad_list_does_not_replace_the_one_held(
    members: tuple[Path, Credentials, Credentials, Credentials], case: str, caplog: pytest.LogCaptureFixture
) -> None:
    ca_dir, me, peer, outsider = members
    data = _forged(ca_dir, outsider)[case]
    held = (me.folder / files.REVOKED).read_bytes()
    version = me.revocation_version

    async def go() -> tuple[bool, bool]:
        g = RevocationGossip(Transport(me))
        # served by a real member over mutual TLS, announced by a beat with a forged higher version
        app = web.Application()

        async def revoked(_: web.Request) -> web.Response:
            return web.Response(body=data, content_type="application/json")

        app.router.add_get("/v1/cluster/revoked", revoked)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=Transport(peer).server_ssl)
        await site.start()
        port = int(runner.addresses[0][1])
        try:
            g.on_beat(_beat(peer.node_id, port, 9), ("127.0.0.1", port))
            assert g._task is not None
            await asyncio.wait_for(g._task, 10)
            g.on_beat(_beat(peer.node_id, port, 9), ("127.0.0.1", port))  # backing off: no new fetch
            again = g._task is not None and not g._task.done()
            direct = await g.take(data, peer.node_id, 9)
        finally:
            await runner.cleanup()
        return again, direct

    with caplog.at_level("WARNING", logger="agent.cluster.revocation_gossip"):
        again, direct = asyncio.run(go())
    assert not again and not direct
    assert me.revocation_version == version
    assert (me.folder / files.REVOKED).read_bytes() == held
    assert Credentials.load(me.folder).revocation_version == version
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]  # rate-limited: one, not one per try
    assert "revocation list" in warnings[0].getMessage()


def test_a_valid_newer_list_is_adopted(members: tuple[Path, Credentials, Credentials, Credentials]) -> None:
    ca_dir, me, peer, _ = members
    ca = Credentials.load(ca_dir)
    assert ca.ca_key is not None
    v1 = revocation.add(ca.revoked or revocation.empty(ca.ca_key, ca.ca_cert), ca.ca_key, ca.ca_cert, peer.node_id)
    g = RevocationGossip(Transport(me))
    assert asyncio.run(g.take(json.dumps(v1.to_json()).encode(), ca.node_id, v1.version))
    assert me.revocation_version == v1.version and me.is_revoked(peer.node_id)
    assert Credentials.load(me.folder).revocation_version == v1.version  # written to revoked.json
    with pytest.raises(SecurityError, match="revoked"):  # its certificate is refused now
        me.peer_node_id(peer.node_cert_der)
