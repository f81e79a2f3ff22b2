"""Secure by default (issue 26, item 3), on real agent processes and loopback sockets.

An agent without cluster credentials and without ``--insecure`` waits for a cluster: no data
port, no UDP socket (no election, no mDNS), only its local API, which says ``no_cluster`` with a
hint (logged once at WARNING). The same running processes then become members without a
restart: one through ``lakeshard cluster init`` in a terminal (its security folder is watched),
the other through ``POST /v1/cluster/join`` on its local API with a token from the first; their
data ports then serve TLS 1.3 only. ``serve`` without credentials refuses to start.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from agent.common.config import ConfigError, parse
from agent.security import files
from agent.security.credentials import Credentials
from agent.security.transport import NO_CLUSTER_HINT
from tests.support.agents import Agent
from tests.support.cli import run_cli
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(240)


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def exchange(port: int, ctx: ssl.SSLContext | None, path: str = "/v1/node") -> tuple[bytes, str | None] | Exception:
    """A GET on a data port (TLS with ``ctx``, else plain): the answer and the TLS version."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            sock = ctx.wrap_socket(raw) if ctx is not None else raw
            version = sock.version() if isinstance(sock, ssl.SSLSocket) else None
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n".encode())
            out = b""
            while chunk := sock.recv(65536):
                out += chunk
            return out, version
    except (OSError, ssl.SSLError) as e:
        return e


def no_cluster_warnings(a: Agent) -> list[str]:
    return [x for x in a.lines if x.startswith("WARNING") and "not in a cluster" in x]


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent, socket.socket]]:
    """Two waiting agents: ``a`` (mDNS off, a static peer we listen on) and ``b`` (mDNS on)."""
    root = tmp_path_factory.mktemp("secdefault")
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    peer = f"127.0.0.1:{udp.getsockname()[1]}"
    a = Agent(root / "a", "--no-mdns", "--static-peers", peer)
    b = Agent(root / "b")
    try:
        wait_until(lambda: a.answers() and b.answers(), 60, what="both local APIs")
        yield a, b, udp
    finally:
        a.stop()
        b.stop()
        udp.close()


def test_without_credentials_an_agent_waits_for_a_cluster(agents: tuple[Agent, Agent, socket.socket]) -> None:
    a, b, udp = agents
    for ag in (a, b):
        node = ag.get("/v1/node")
        assert node["state"] == "no_cluster" and node["hint"] == NO_CLUSTER_HINT and node["port"] is None, node
        assert node["api_port"] == ag.api and node["coordinator"] is None
        assert ag.get("/v1/cluster")["role"] == "no_cluster"
        assert refused(ag.port)  # no data port
        # no UDP socket at all (no election, no mDNS), and only the local API listens, on loopback
        conns = psutil.Process(ag.proc.pid).net_connections(kind="inet")
        assert not [c for c in conns if c.type == socket.SOCK_DGRAM], conns
        listening = {c.laddr for c in conns if c.status == psutil.CONN_LISTEN}
        assert {(x.ip, x.port) for x in listening} == {("127.0.0.1", ag.api)}, conns
        # what needs a cluster says so in one line
        status, body = ag.post("/v1/node/state", {"state": "paused"})
        assert status == 409 and body["error"]["message"] == NO_CLUSTER_HINT
        status, body = ag.post("/v1/cluster/invite", {})
        assert status == 409 and body["error"]["code"] == "not_in_cluster", body
        assert ag.get("/v1/cluster/identity")["member"] is False
    # no web page can do it for the user: a browser's Origin, or another Host (DNS rebinding)
    for headers in ({"Origin": "https://example.com"}, {"Host": f"evil.example:{a.api}"}):
        status, body = a.post("/v1/cluster/init", {}, headers=headers)
        assert status == 403 and body["error"]["code"] == "forbidden", body
    assert not (a.security / files.NODE_CERT).exists()
    udp.settimeout(2.0)  # its static peer hears nothing (an elector would beat several times a second)
    with pytest.raises(TimeoutError):
        udp.recvfrom(2048)
    for ag in (a, b):
        warned = no_cluster_warnings(ag)
        assert len(warned) == 1 and "lakeshard cluster init" in warned[0] and "cluster join TOKEN" in warned[0]
        assert any("waiting for a cluster" in x for x in ag.lines) and not any("listening on" in x for x in ag.lines)
    # `lakeshard status` says the same
    r = run_cli("status", "--api-port", str(a.api), env=a.env)
    assert r.returncode == 0 and NO_CLUSTER_HINT in r.stdout, r


def test_credentials_from_the_cli_or_the_local_api_start_it_without_a_restart(
    agents: tuple[Agent, Agent, socket.socket],
) -> None:
    a, b, _ = agents
    pids = a.proc.pid, b.proc.pid
    # b: 'lakeshard cluster init' in a terminal, in its home; the running agent notices
    r = run_cli("cluster", "init", env=b.env)
    assert r.returncode == 0, r.stderr
    bc = Credentials.load(b.security)
    wait_until(lambda: isinstance(exchange(b.port, bc.client_ssl_context()), tuple), 20, what="b serving TLS")
    node = b.get("/v1/node")
    assert node["cluster"] == bc.cluster_id and node["links"] == "TLS" and node["holds_ca"] and node["port"] == b.port
    assert any(f"listening on 127.0.0.1:{b.port} (TLS)" in x for x in b.lines), b.lines
    udp = [c for c in psutil.Process(b.proc.pid).net_connections(kind="inet") if c.type == socket.SOCK_DGRAM]
    assert udp  # now it takes part in the election

    # a: joins through its local API with a token from b (a bad token first: its one-line error)
    r = run_cli("cluster", "invite", "--address", f"127.0.0.1:{b.port}", env=b.env)
    assert r.returncode == 0, r.stderr
    status, body = a.post("/v1/cluster/join", {"token": "lsj1-AAAA"})
    assert status == 400 and "too short" in body["error"]["message"] and "\n" not in body["error"]["message"]
    assert a.get("/v1/node")["state"] == "no_cluster"
    status, body = a.post("/v1/cluster/join", {"token": r.stdout.strip()})
    assert status == 200 and body["member"] and body["cluster_id"] == bc.cluster_id, body
    assert body["message"].startswith(f"joined cluster {bc.cluster_id} as node ") and body["agent_error"] is None
    node = a.get("/v1/node")  # at once: the route started it
    assert node["state"] != "no_cluster" and node["links"] == "TLS" and not node["holds_ca"], node
    assert node["api_port"] == a.api and node["port"] == a.port
    ac = Credentials.load(a.security)
    assert ac.node_id == node["node"] and ac.cluster_id == bc.cluster_id
    # its data port: TLS 1.3 for a member; a client without a certificate is refused
    got = exchange(a.port, ac.client_ssl_context())
    assert isinstance(got, tuple) and got[1] == "TLSv1.3" and got[0].startswith(b"HTTP/1.1 200"), got
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.load_verify_locations(cadata=(a.security / files.CA_CERT).read_text())
    bare.check_hostname = False
    got = exchange(a.port, bare)
    assert isinstance(got, tuple) and got[0].startswith(b"HTTP/1.1 403"), got
    got = exchange(a.port, None)  # and no plaintext
    assert isinstance(got, Exception) or not got[0].startswith(b"HTTP/1.1 200"), got
    # the same processes all along, the warning said once, no plaintext anywhere
    assert (a.proc.pid, b.proc.pid) == pids and a.proc.poll() is None and b.proc.poll() is None
    for ag in (a, b):
        assert len(no_cluster_warnings(ag)) == 1
        assert not any("PLAINTEXT" in x for x in ag.lines), ag.lines
    # a member cannot make or join another cluster through the API
    status, body = a.post("/v1/cluster/init", {})
    assert status == 409 and body["error"]["code"] == "in_cluster", body
    status, body = a.post("/v1/cluster/invite", {})
    assert status == 409 and body["error"]["code"] == "not_ca_holder", body


def test_serve_without_credentials_refuses_to_start(tmp_path: Path) -> None:
    r = run_cli("serve", "--nodes", "127.0.0.1:7700", env={"LAKESHARD_HOME": str(tmp_path / "home")}, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lakeshard: error: " + NO_CLUSTER_HINT), r.stderr
    assert "--insecure" in lines[0]


def test_the_insecure_setting(tmp_path: Path) -> None:
    assert parse({"insecure": True}).insecure and not parse({}).insecure
    with pytest.raises(ConfigError, match="insecure: must be true or false"):
        parse({"insecure": "yes"})
    # 'insecure: true' in the settings: plaintext at once, said loudly
    a = Agent(tmp_path / "home", "--no-mdns", "--standalone", config="insecure: true\n")
    try:
        wait_until(lambda: any("listening on" in x for x in a.lines), 60, what="it to listen")
        assert any(f"127.0.0.1:{a.port} (PLAINTEXT)" in x for x in a.lines), a.lines
        assert any(x.startswith("WARNING") and "PLAINTEXT" in x for x in a.lines), a.lines
        got = exchange(a.port, None)
        assert isinstance(got, tuple) and got[0].startswith(b"HTTP/1.1 200"), got
        assert not no_cluster_warnings(a)
    finally:
        a.stop()
