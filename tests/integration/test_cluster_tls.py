"""Mutual TLS between nodes (issue 26, part 2), on real processes and loopback sockets.

A cluster CA in one home, members joined in others (one of them through the real CLI, over TLS,
against the CA holder's running agent), two secure agents and a ``lakeshard serve`` coordinator
that is a member too. The same greedy request through that cluster and through a plaintext one
(``--insecure``) gives the same text; a secure agent's data port answers no plaintext client,
no certificate of another cluster and no revoked node. (An agent without credentials speaks no
plaintext at all unless told to: tests/system/test_secure_default.py.)
"""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from agent.security import cluster, files
from agent.security.credentials import Credentials
from agent.security.errors import SecurityError
from agent.security.transport import Transport
from coordinator.lab.local_cluster import LocalCluster, free_port
from tests.support.cli import run_cli
from tests.support.members import Home, exchange, make_member
from tests.support.served import Served, chat, post_chat
from tests.support.wait import wait_until

PROMPT = "Name three colours of the rainbow."
SERVE_ARGS = ("--model", "smollm2-135m", "--weights", "int8")


@dataclass
class Secure:
    served: Served
    ca: Home
    other: Home
    outsider: Credentials  # a member of another cluster
    spare: Credentials  # a member of this cluster, revoked by a test


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory, smollm2: object) -> Iterator[Secure]:
    root = tmp_path_factory.mktemp("tls")
    a, b, s = Home(root / "a", free_port()), Home(root / "b", free_port()), Home(root / "serve")
    cluster.init_cluster(a.node(), files.security_dir(a.security))
    make_member(a.security, files.security_dir(b.security), b.node())
    spare = make_member(a.security, files.security_dir(root / "spare"), "5a5a5a5a5a5a")
    outsider = cluster.init_cluster("0b0b0b0b0b0b", files.security_dir(root / "outsider"))
    # the serve process joins through the real CLI, over TLS, while the CA holder's agent runs
    holder = LocalCluster(1, device="CPU", agent_envs=[a.env], ports=[a.port], secure=True).start()
    try:
        r = run_cli("cluster", "invite", "--address", f"127.0.0.1:{a.port}", env=a.env, timeout=60)
        assert r.returncode == 0, r.stderr
        r = run_cli("cluster", "join", r.stdout.strip(), env=s.env, timeout=60)
        assert r.returncode == 0, r.stderr
    finally:
        holder.stop()
    assert Credentials.load(s.security).cluster_id == Credentials.load(a.security).cluster_id
    served = Served(
        2,
        *SERVE_ARGS,
        env=s.env,
        agent_envs=[a.env, b.env],
        ports=[a.port, b.port],
        agent_args=["--device", "CPU"],
        secure=True,
    )
    try:
        yield Secure(served, a, b, outsider, spare)
    finally:
        served.stop()


def test_same_text_as_plaintext(secure: Secure) -> None:
    secure_text = chat(secure.served, PROMPT, max_tokens=24, temperature=0)
    plain = Served(2, *SERVE_ARGS, agent_args=["--device", "CPU"])  # --insecure: plaintext
    try:
        assert chat(plain, PROMPT, max_tokens=24, temperature=0) == secure_text
        assert any("PLAINTEXT" in line and "--insecure" in line for line in plain.output), plain.output[-20:]
    finally:
        plain.stop()
    assert secure_text.strip()
    assert not any("PLAINTEXT" in line for line in secure.served.output)


def trusting(creds: Credentials, ca: Path) -> ssl.SSLContext:
    """``creds``' client context, also trusting the CA in ``ca`` (so only the server can refuse)."""
    ctx = creds.client_ssl_context()
    ctx.load_verify_locations(cadata=(ca / files.CA_CERT).read_text())
    return ctx


def test_member_is_served(secure: Secure) -> None:
    b = Credentials.load(secure.other.security)
    got = exchange(secure.ca.port, b.client_ssl_context())
    assert isinstance(got, bytes) and got.startswith(b"HTTP/1.1 200"), got


def test_plaintext_client_gets_nothing(secure: Secure) -> None:
    got = exchange(secure.ca.port, None)
    assert isinstance(got, BaseException) or not got.startswith(b"HTTP/1.1 200"), got
    assert not isinstance(got, bytes) or b'"node"' not in got

    async def ws() -> None:
        async with aiohttp.ClientSession() as s:
            await s.ws_connect(f"ws://127.0.0.1:{secure.ca.port}/ws")

    with pytest.raises((aiohttp.ClientError, OSError)):
        asyncio.run(ws())


def test_no_certificate_only_the_public_routes(secure: Secure) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=(secure.ca.security / files.CA_CERT).read_text())
    ctx.check_hostname = False
    got = exchange(secure.ca.port, ctx)
    assert isinstance(got, bytes) and got.startswith(b"HTTP/1.1 403"), got
    assert b'"code": "no_certificate"' in got  # the JSON error shape of every lakeshard API
    got = exchange(secure.ca.port, ctx, "/v1/cluster/no-such-route")
    assert isinstance(got, bytes) and got.startswith(b"HTTP/1.1 403"), got  # refused before routing
    got = exchange(secure.ca.port, ctx, "/v1/cluster/ca")  # what a joiner asks first
    assert isinstance(got, bytes) and got.startswith(b"HTTP/1.1 200"), got


def test_another_clusters_certificate_refused_at_handshake(secure: Secure) -> None:
    got = exchange(secure.ca.port, trusting(secure.outsider, secure.ca.security))
    assert isinstance(got, ssl.SSLError | ConnectionResetError | BrokenPipeError) or got == b"", got


def test_revoked_node_refused(secure: Secure) -> None:
    ctx = secure.spare.client_ssl_context()
    got = exchange(secure.ca.port, ctx)
    assert isinstance(got, bytes) and got.startswith(b"HTTP/1.1 200"), got
    # the CA holder revokes it (the CLI's operation); its running agent re-reads the list
    cluster.revoke(secure.spare.node_id, secure.ca.security)
    got = wait_until(
        lambda: exchange(secure.ca.port, ctx),
        10,
        what="the revoked node's request refused (403)",
        ok=lambda g: isinstance(g, bytes) and g.startswith(b"HTTP/1.1 403"),
        step=0.5,
    )
    assert isinstance(got, bytes) and b"revoked" in got
    # the rest of the cluster still serves
    assert chat(secure.served, PROMPT, max_tokens=4, temperature=0)


def local_get(api_port: int, path: str) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{api_port}{path}", timeout=5) as r:
            return dict(json.loads(r.read()))
    except (OSError, ValueError):
        return None


def test_elected_agents_serve_over_tls(secure: Secure, tmp_path: Path) -> None:
    """Two full agents (election, static peers) with credentials: the elected one plans, assigns
    and serves over TLS, and the other's local API reaches it through the TLS gateway."""
    homes = [Home(tmp_path / "c", free_port()), Home(tmp_path / "d", free_port())]
    for h in homes:
        make_member(secure.ca.security, files.security_dir(h.security), h.node())
    cid = Credentials.load(secure.ca.security).cluster_id
    elect = ["--serve-model", "smollm2-135m", "--serve-weights", "int8", "--device", "CPU"]
    for h in homes:  # a cluster id that is not the certificate's: the certificate wins (with a warning)
        (h.path / "config" / "config.yaml").write_text("cluster_id: office\n", encoding="utf-8")
    with LocalCluster(
        2, elect=elect, agent_envs=[h.env for h in homes], ports=[h.port for h in homes], log_dir=tmp_path, secure=True
    ) as c:
        wait_until(
            lambda: all(local_get(p, "/v1/models") for p in c.api_ports),
            300,
            what="both agents' local APIs to list the model",
            step=0.5,
            diagnose=lambda: [local_get(p, "/v1/cluster") for p in c.api_ports],
        )
        views = [local_get(p, "/v1/cluster") or {} for p in c.api_ports]
        assert all(v["cluster"] == cid for v in views), views
        gateways = [v["gateway"] for v in views]
        far = c.api_ports[[bool(g["here"]) for g in gateways].index(False)]  # type: ignore[index]
        near = c.api_ports[[bool(g["here"]) for g in gateways].index(True)]  # type: ignore[index]
        services = next(v["services"] for v in views if v.get("services"))
        # the plan says how much context its stages' KV pools would hold (SmolLM2 at f32: 30 layers)
        assert services["context_tokens"] == min(s["kv_tokens"] for s in services["plan"]) > 2000, services
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "temperature": 0}
        status, a = post_chat(f"http://127.0.0.1:{far}", body)
        assert status == 200, a
        status, b = post_chat(f"http://127.0.0.1:{near}", body)
        assert status == 200, b
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
        for h in homes:  # their data ports speak TLS only
            got = exchange(h.port, None)
            assert not isinstance(got, bytes) or not got.startswith(b"HTTP/1.1 200"), got
    logs = [(tmp_path / f"agent{i}.log").read_text(errors="replace") for i in range(2)]
    for text in logs:
        assert "is not this node's cluster: using " + cid in text and "(TLS)" in text, text[-3000:]
        assert "PLAINTEXT" not in text


def test_node_at_reads_the_certificate(secure: Secure) -> None:
    """What the gateway checks before it forwards to the coordinator: who serves that address."""
    a, b = Credentials.load(secure.ca.security), Credentials.load(secure.other.security)
    address = f"127.0.0.1:{secure.ca.port}"
    assert asyncio.run(Transport(b).node_at(address)) == a.node_id
    with pytest.raises(SecurityError):  # another cluster's CA: no handshake
        asyncio.run(Transport(secure.outsider).node_at(address))
    assert asyncio.run(Transport().node_at(address)) is None  # plaintext: nothing to check
    assert Transport(b).url("10.0.0.5:7700", "/ws", ws=True) == "wss://10.0.0.5:7700/ws"
    assert Transport().url("10.0.0.5:7700", "/v1/node") == "http://10.0.0.5:7700/v1/node"
