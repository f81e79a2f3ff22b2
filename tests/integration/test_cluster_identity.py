"""Cluster identity (issue 26, part 1): the CA, node certificates, the revocation list, TLS between
members on loopback, and joining through a real agent process with the real CLI."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import hashlib
import json
import os
import secrets
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.security import SecurityError, ca_store, cluster, files, join, pki, revocation, tokens
from agent.security.ca_store import Refused
from agent.security.credentials import Credentials
from tests.support.cli import REPO, run_cli
from tests.support.members import join_request, make_member
from tests.support.wait import wait_until

NODE_A, NODE_B, NODE_C = "aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc"


# -- helpers -------------------------------------------------------------------------------------


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    d = files.security_dir(tmp_path / "a")
    cluster.init_cluster(NODE_A, d)
    return d


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


# -- the CA and certificates ---------------------------------------------------------------------
def test_init_files_and_permissions(ca_dir: Path) -> None:
    assert mode(ca_dir) == 0o700
    for name in ("ca.key", "node.key", "issued.json"):
        assert mode(ca_dir / name) == 0o600, name
    for name in ("ca.crt", "node.crt", "revoked.json"):
        assert mode(ca_dir / name) == 0o644, name
    cluster.invite("127.0.0.1:7700", 3600, 1, ca_dir)
    assert mode(ca_dir / "invites.json") == 0o600
    # a rewrite keeps 0600, and leaves no temporary file behind
    cluster.invite("127.0.0.1:7700", 3600, 1, ca_dir)
    assert mode(ca_dir / "invites.json") == 0o600
    assert not [p for p in ca_dir.iterdir() if p.name.endswith(".tmp")]
    assert b"PRIVATE KEY" in (ca_dir / "ca.key").read_bytes()


def test_ca_and_node_certificates(ca_dir: Path) -> None:
    creds = Credentials.load(ca_dir)
    ca = creds.ca_cert
    fp = hashlib.sha256(ca.public_bytes(serialization.Encoding.DER)).digest()
    assert creds.cluster_id == base64.b32encode(fp[:16]).decode().lower().rstrip("=")
    assert len(creds.cluster_id) == 26 and pki.CLUSTER_ID_RE.match(creds.cluster_id)
    # the CA: self-signed, a CA, P-256, ten years
    ca.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey) and ca.public_key().curve.name == "secp256r1"
    years = (ca.not_valid_after_utc - ca.not_valid_before_utc).days / 365.25
    assert 9.9 < years < 10.1
    # the node: CN = node id, O = cluster id, one year, P-256, signed by the CA, both TLS uses
    cert = creds.node_cert
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == NODE_A
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == creds.cluster_id
    assert 364 <= (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 366
    assert cert.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    cert.verify_directly_issued_by(ca)
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku and ExtendedKeyUsageOID.CLIENT_AUTH in eku
    assert creds.holds_ca and creds.node_id == NODE_A
    # random serials
    key = pki.new_key()
    s1 = pki.issue(creds.ca_key, ca, pki.make_csr(key, NODE_B)).serial_number  # type: ignore[arg-type]
    s2 = pki.issue(creds.ca_key, ca, pki.make_csr(key, NODE_B)).serial_number  # type: ignore[arg-type]
    assert s1 != s2 and s1.bit_length() > 100


def test_init_refuses_to_replace_without_force(ca_dir: Path) -> None:
    old = Credentials.load(ca_dir).cluster_id
    with pytest.raises(SecurityError, match="--force"):
        cluster.init_cluster(NODE_A, ca_dir)
    assert Credentials.load(ca_dir).cluster_id == old
    cluster.invite("127.0.0.1:7700", 60, 1, ca_dir)
    new = cluster.init_cluster(NODE_A, ca_dir, force=True)
    assert new.cluster_id != old and not (ca_dir / "invites.json").exists()


def test_node_cert_checks(ca_dir: Path, tmp_path: Path) -> None:
    creds = Credentials.load(ca_dir)
    other = files.security_dir(tmp_path / "other")
    cluster.init_cluster(NODE_C, other)
    foreign = Credentials.load(other).node_cert
    with pytest.raises(SecurityError, match="not signed by this cluster's CA"):
        pki.check_node_cert(foreign, creds.ca_cert)
    with pytest.raises(SecurityError, match="not signed by this cluster's CA"):
        creds.peer_node_id(pki.cert_der(foreign))
    with pytest.raises(SecurityError, match="not valid now"):
        pki.check_node_cert(creds.node_cert, creds.ca_cert, now=dt.datetime.now(dt.UTC) + dt.timedelta(days=400))
    with pytest.raises(SecurityError, match="CA certificate"):
        creds.peer_node_id(pki.cert_der(creds.ca_cert))
    assert creds.peer_node_id(creds.node_cert_der) == NODE_A


# -- the revocation list -------------------------------------------------------------------------
def test_revocation_list_signature_and_versions(ca_dir: Path, tmp_path: Path) -> None:
    b = make_member(ca_dir, files.security_dir(tmp_path / "b"), NODE_B)
    assert b.revocation_version == 0 and not b.is_revoked(NODE_C)
    rl1 = cluster.revoke(NODE_C, ca_dir)
    assert rl1.version == 1 and NODE_C in rl1.nodes
    assert cluster.revoke(NODE_C, ca_dir).version == 1  # already revoked: unchanged
    with pytest.raises(SecurityError, match="cannot revoke itself"):
        cluster.revoke(NODE_A, ca_dir)
    with pytest.raises(SecurityError, match="not a node id"):
        cluster.revoke("nobody", ca_dir)
    with pytest.raises(SecurityError, match="holds the cluster CA"):
        cluster.revoke(NODE_C, b.folder)
    data = (ca_dir / "revoked.json").read_bytes()
    # tampered lists are refused, whoever hands them over
    for change in (
        lambda d: d["entries"].clear(),
        lambda d: d.update(version=9),
        lambda d: d["entries"].append({"node": NODE_A, "at": 1}),
        lambda d: d.update(signature=base64.b64encode(b"x" * 70).decode()),
    ):
        d = json.loads(data)
        change(d)
        with pytest.raises(SecurityError, match="signature"):
            b.adopt(json.dumps(d).encode())
    assert b.revocation_version == 0
    # another cluster's list is refused too
    other = files.security_dir(tmp_path / "other")
    cluster.init_cluster(NODE_C, other)
    cluster.revoke(NODE_B, other)
    with pytest.raises(SecurityError, match="for cluster"):
        b.adopt((other / "revoked.json").read_bytes())
    # the newer list is taken (and kept on disk); the same or an older one is not
    assert b.adopt(data) and b.is_revoked(NODE_C)
    assert Credentials.load(b.folder).is_revoked(NODE_C)
    assert not b.adopt(data)
    creds = Credentials.load(ca_dir)
    v0 = revocation.empty(creds.ca_key, creds.ca_cert)  # type: ignore[arg-type]
    assert not b.adopt(v0.to_json()) and b.revocation_version == 1
    rl2 = cluster.revoke(NODE_B, ca_dir)
    assert b.adopt(rl2) and b.revocation_version == 2


# -- TLS between members -------------------------------------------------------------------------
async def handshake(server: Credentials, client: Credentials) -> dict[str, Any]:
    """A real TLS connection on loopback: what each side makes of the other."""
    got: dict[str, Any] = {}
    handlers: list[asyncio.Task[Any]] = []  # the server's side of the connection, once its handshake is done

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        obj = writer.get_extra_info("ssl_object")
        got["version"] = obj.version()
        try:
            got["server_saw"] = server.peer_node_id(obj)
            writer.write(b"ok")
            await writer.drain()
        except SecurityError as e:
            got["server_refused"] = str(e)
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server.server_ssl_context())
    port = srv.sockets[0].getsockname()[1]
    try:
        r, w = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, ssl=client.client_ssl_context()), timeout=10
        )
    except (ssl.SSLError, ConnectionError) as e:
        got["client_failed"] = repr(e)
    else:
        got["client_saw"] = client.peer_node_id(w.get_extra_info("ssl_object"))
        try:
            got["client_read"] = await asyncio.wait_for(r.read(2), timeout=10)
        except (ssl.SSLError, ConnectionError) as e:
            got["client_read"] = repr(e)
        w.close()
    # what the server made of the client (the client only reads an answer or the close after it)
    await asyncio.wait_for(asyncio.gather(*handlers), 10)
    srv.close()
    await srv.wait_closed()
    return got


async def test_tls_between_members(ca_dir: Path, tmp_path: Path) -> None:
    a = Credentials.load(ca_dir)
    b = make_member(ca_dir, files.security_dir(tmp_path / "b"), NODE_B)
    got = await handshake(a, b)
    assert got["version"] == "TLSv1.3"
    assert got["server_saw"] == NODE_B and got["client_saw"] == NODE_A and got["client_read"] == b"ok"
    got = await handshake(b, a)
    assert got["server_saw"] == NODE_A and got["client_saw"] == NODE_B


async def test_tls_refuses_another_cluster(ca_dir: Path, tmp_path: Path) -> None:
    a = Credentials.load(ca_dir)
    other = files.security_dir(tmp_path / "other")
    c = cluster.init_cluster(NODE_C, other)
    got = await handshake(a, c)  # a stranger's client certificate: the server never accepts it
    assert "server_saw" not in got and "server_refused" not in got
    assert got.get("client_read") != b"ok"
    got = await handshake(c, a)  # a stranger's server: the client refuses it in the handshake
    assert "certificate verify failed" in got["client_failed"] and "server_saw" not in got


async def test_tls_refuses_a_revoked_node(ca_dir: Path, tmp_path: Path) -> None:
    b = make_member(ca_dir, files.security_dir(tmp_path / "b"), NODE_B)
    cluster.revoke(NODE_B, ca_dir)
    a = Credentials.load(ca_dir)
    got = await handshake(a, b)
    assert got["server_refused"] == f"node {NODE_B} is revoked" and got.get("client_read") != b"ok"


def test_signatures(ca_dir: Path, tmp_path: Path) -> None:
    a = Credentials.load(ca_dir)
    b = make_member(ca_dir, files.security_dir(tmp_path / "b"), NODE_B)
    beat = b"term=7 node=aaaaaaaaaaaa"
    sig = a.sign(beat)
    assert b.verify(a.node_cert_der, beat, sig) == NODE_A
    with pytest.raises(SecurityError, match="not node aaaaaaaaaaaa's"):
        b.verify(a.node_cert_der, beat + b"!", sig)
    with pytest.raises(SecurityError, match="not node aaaaaaaaaaaa's"):
        b.verify(a.node_cert_der, beat, b.sign(beat))  # b's signature with a's certificate
    c = cluster.init_cluster(NODE_C, files.security_dir(tmp_path / "other"))
    with pytest.raises(SecurityError, match="not signed by this cluster's CA"):
        b.verify(c.node_cert_der, beat, c.sign(beat))
    cluster.revoke(NODE_B, ca_dir)
    a.refresh()
    with pytest.raises(SecurityError, match="revoked"):
        a.verify(b.node_cert_der, beat, b.sign(beat))


# -- the member's side of joining, without a network ---------------------------------------------
def test_answer_join_refusals(ca_dir: Path, tmp_path: Path) -> None:
    a = Credentials.load(ca_dir)
    tok = tokens.parse_token(cluster.invite("127.0.0.1:7700", 60, 1, ca_dir))

    def refused(body: bytes, now: float | None = None) -> tuple[int, str]:
        with pytest.raises(Refused) as e:
            join.answer_join(a, body, now)
        return e.value.status, e.value.code

    forged = tokens.JoinToken(tok.address, tok.cluster_id, secrets.token_hex(8), tok.secret)
    assert refused(join_request(forged, NODE_B)[1]) == (403, "token_unknown")
    assert refused(join_request(tok, NODE_B, secret=secrets.token_bytes(16))[1]) == (403, "bad_proof")
    p384 = ec.generate_private_key(ec.SECP384R1())
    assert refused(join_request(tok, NODE_B, p384)[1]) == (400, "bad_csr")
    body = json.loads(join_request(tok, NODE_B)[1])
    bad_cn = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "alice")])
    )
    key = pki.new_key()
    csr = bad_cn.sign(key, hashes.SHA256())
    nonce = bytes(16)
    body.update(csr=pki.csr_pem(csr).decode(), nonce=nonce.hex())
    body["proof"] = tokens.proof(tok.key, tok.token_id, pki.csr_der(csr), nonce).hex()
    assert refused(json.dumps(body).encode()) == (400, "bad_csr")
    assert refused(join_request(tok, NODE_A)[1]) == (409, "node_taken")  # the CA holder's own id
    assert refused(b"not json") == (400, "bad_request")
    assert refused(b"[]") == (400, "bad_request")
    assert refused(json.dumps({"token": tok.token_id}).encode()) == (400, "bad_request")
    assert refused(b"{" + b" " * join.MAX_BODY + b"}") == (413, "request_too_large")
    assert refused(join_request(tok, NODE_B)[1], now=time.time() + 120) == (410, "token_expired")
    cluster.revoke(NODE_C, ca_dir)
    a = Credentials.load(ca_dir)
    assert refused(join_request(tok, NODE_C)[1]) == (403, "node_revoked")
    # none of those spent the token: it still works once, then no more
    assert ca_store.outstanding(ca_dir) == 1
    ans = join.answer_join(a, join_request(tok, NODE_B)[1])
    assert pki.node_of(pki.load_cert(ans["cert"].encode())) == NODE_B and ans["signed_by"] == NODE_A
    assert refused(join_request(tok, NODE_B)[1]) == (410, "token_used")
    # a member that does not hold the CA says so, and names the node that signed it
    b = make_member(ca_dir, files.security_dir(tmp_path / "b2"), "b2b2b2b2b2b2")
    files.write_json(b.folder / files.MEMBER, {"signed_by": NODE_A})
    with pytest.raises(Refused, match=f"node {NODE_A} signed its certificate") as e:
        join.answer_join(b, join_request(tok, NODE_B)[1])
    assert e.value.status == 404


# -- joining through a real agent process --------------------------------------------------------
class Relay:
    """A TCP relay on loopback that records every byte in both directions."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.up: list[bytes] = []  # joiner -> member
        self.down: list[bytes] = []  # member -> joiner
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(c, u, self.up), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, self.down), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, log: list[bytes]) -> None:
        try:
            while data := src.recv(65536):
                log.append(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    @property
    def seen(self) -> bytes:
        return b"".join(self.up) + b"".join(self.down)

    def close(self) -> None:
        self.sock.close()


class Member:
    """A CA holder: its LAKESHARD_HOME (made with ``cluster init``) and its agent process."""

    def __init__(self, home: Path) -> None:
        from coordinator.lab.local_cluster import free_port

        self.home, self.port = home, free_port()
        (home / "config").mkdir(parents=True)
        (home / "config" / "config.yaml").write_text(f"port: {self.port}\n", encoding="utf-8")
        self.env = {"LAKESHARD_HOME": str(home)}
        r = run_cli("cluster", "init", env=self.env)
        assert r.returncode == 0, r.stderr
        self.cluster_id = r.stdout.split()[1].rstrip(":")
        self.node = r.stdout.split("node ")[1].split()[0]
        cmd = [sys.executable, "-m", "agent", "agent", "--host", "127.0.0.1", "--port", str(self.port)]
        # --insecure: these tests watch the join protocol on the wire (it must be safe over plain
        # HTTP); joining an agent that serves TLS is in test_cluster_tls.py
        cmd += ["--api-port", "0", "--no-mdns", "--device", "CPU", "--standalone", "--throttle", "off", "--insecure"]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", **self.env}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
        wait_until(self._answers, 60, what="the agent to answer", ignore=(OSError,))

    def _answers(self) -> bool:
        assert self.proc.poll() is None, "the agent exited"
        return self.get("/v1/cluster/ca")[0] == 200

    @property
    def folder(self) -> Path:
        return self.home / "config" / "security"

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        return post(self.port, path, None)

    def invite(self, *extra: str, address: str | None = None) -> str:
        r = run_cli("cluster", "invite", "--address", address or f"127.0.0.1:{self.port}", *extra, env=self.env)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def post(port: int, path: str, body: bytes | None) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def member(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Member]:
    m = Member(tmp_path_factory.mktemp("member") / "home")
    yield m
    m.stop()


def joiner(tmp_path: Path, name: str = "b") -> dict[str, str]:
    return {"LAKESHARD_HOME": str(tmp_path / name)}


def one_line_error(r: subprocess.CompletedProcess[str], text: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lakeshard: error: ") and text in lines[0], r.stderr


def test_join_end_to_end(member: Member, tmp_path: Path) -> None:
    relay = Relay(member.port)
    try:
        token = member.invite("--expires", "1h", address=f"127.0.0.1:{relay.port}")
        tok = tokens.parse_token(token)
        assert tok.cluster_id == member.cluster_id
        env = joiner(tmp_path)
        r = run_cli("cluster", "join", token, env=env)
        assert r.returncode == 0, r.stderr
        assert f"joined cluster {member.cluster_id} as node " in r.stdout
        seen = relay.seen
        # the same token again, from another node: refused in one line
        one_line_error(run_cli("cluster", "join", token, env=joiner(tmp_path, "c")), "already been used")
        assert not (tmp_path / "c" / "config" / "security" / "node.key").exists()
    finally:
        relay.close()
    # the relay did carry the join (the CSR and the certificate), and never the secret
    assert b"POST /v1/cluster/join" in seen and b"CERTIFICATE REQUEST" in seen and b'"mac"' in seen
    s = tok.secret
    forms = [s, s.hex().encode(), s.hex().upper().encode(), base64.b64encode(s), base64.urlsafe_b64encode(s)]
    forms += [f.rstrip(b"=") for f in forms[3:]] + [token.encode(), token[5:].encode(), tok.key, tok.key.hex().encode()]
    for f in forms:
        assert f not in seen, f
    # the stored credentials: a member of the CA's cluster, its key 0600
    b = Credentials.load(tmp_path / "b" / "config" / "security")
    a = Credentials.load(member.folder)
    assert pki.check_node_cert(b.node_cert, a.ca_cert) == b.node_id and b.cluster_id == member.cluster_id
    assert not b.holds_ca and mode(b.folder / "node.key") == 0o600
    assert a.peer_node_id(b.node_cert_der) == b.node_id
    st = json.loads(run_cli("cluster", "status", "--json", env=env).stdout)
    assert st["member"] and st["cluster_id"] == member.cluster_id and st["signed_by"] == member.node
    assert st["holds_ca"] is False and st["revocation_version"] == 0
    # this node is a member already
    one_line_error(run_cli("cluster", "join", member.invite(), env=env), "already in a cluster")


def test_expired_token(member: Member, tmp_path: Path) -> None:
    token = member.invite("--expires", "1s")
    time.sleep(1.5)  # the scenario (not a wait): the token's second of life runs out on the wall clock
    one_line_error(run_cli("cluster", "join", token, env=joiner(tmp_path)), "has expired")


def test_wrong_secret(member: Member, tmp_path: Path) -> None:
    tok = tokens.parse_token(member.invite())
    wrong = tokens.JoinToken(tok.address, tok.cluster_id, tok.token_id, secrets.token_bytes(16)).encode()
    one_line_error(run_cli("cluster", "join", wrong, env=joiner(tmp_path)), "secret is wrong")
    unknown = tokens.JoinToken(tok.address, tok.cluster_id, secrets.token_hex(8), tok.secret).encode()
    one_line_error(run_cli("cluster", "join", unknown, env=joiner(tmp_path)), "does not know this join token")
    # the real one still works: failed proofs spend nothing
    r = run_cli("cluster", "join", tok.encode(), env=joiner(tmp_path))
    assert r.returncode == 0, r.stderr


def test_forged_cluster_id(member: Member, tmp_path: Path) -> None:
    relay = Relay(member.port)
    try:
        tok = tokens.parse_token(member.invite(address=f"127.0.0.1:{relay.port}"))
        fake = pki.cluster_id_from_bytes(secrets.token_bytes(16))
        forged = tokens.JoinToken(tok.address, fake, tok.token_id, tok.secret).encode()
        one_line_error(run_cli("cluster", "join", forged, env=joiner(tmp_path)), f"token names cluster {fake}")
        seen = relay.seen
    finally:
        relay.close()
    assert b"GET /v1/cluster/ca" in seen and b"/v1/cluster/join" not in seen and b"proof" not in seen


def test_unreachable_and_bad_tokens(tmp_path: Path) -> None:
    from coordinator.lab.local_cluster import free_port

    tok = tokens.new_token(f"127.0.0.1:{free_port()}", pki.cluster_id_from_bytes(bytes(16))).encode()
    one_line_error(run_cli("cluster", "join", tok, env=joiner(tmp_path)), "cannot reach the cluster member")
    one_line_error(run_cli("cluster", "join", "lsj1-AAAA", env=joiner(tmp_path)), "too short")
    one_line_error(run_cli("cluster", "invite", env=joiner(tmp_path)), "not in a secured cluster")
    r = run_cli("cluster", "status", env=joiner(tmp_path))
    assert r.returncode == 0 and "not in a secured cluster" in r.stdout


def test_cli_argument_errors(member: Member) -> None:
    for args, text in [
        (["--expires", "2x"], "not a duration"),
        (["--expires", "400d"], "between 1s and 365d"),
        (["--uses", "0"], "between 1 and 1000"),
        (["--uses", "many"], "not a number of uses"),
        (["--address", "nowhere"], "is not host:port"),
    ]:
        one_line_error(run_cli("cluster", "invite", *args, env=member.env), text)
    one_line_error(run_cli("cluster", "init", env=member.env), "--force")
    one_line_error(run_cli("cluster", "revoke", "xyz", env=member.env), "not a node id")


def test_default_invite_address(member: Member) -> None:
    from agent.cluster.discovery import local_addresses

    r = run_cli("cluster", "invite", env=member.env)
    if not local_addresses():
        one_line_error(r, "no LAN address")
        return
    assert r.returncode == 0, r.stderr
    assert tokens.parse_token(r.stdout.strip()).address.endswith(f":{member.port}")


def test_single_use_under_concurrent_joins(member: Member) -> None:
    tok = tokens.parse_token(member.invite("--uses", "1"))
    bodies = [join_request(tok, f"{i:012x}")[1] for i in range(1, 5)]
    results: list[int] = []
    gate = threading.Barrier(len(bodies))

    def go(body: bytes) -> None:
        gate.wait()
        results.append(post(member.port, "/v1/cluster/join", body)[0])

    threads = [threading.Thread(target=go, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == [200, 410, 410, 410]


def test_member_routes(member: Member) -> None:
    status, d = member.get("/v1/cluster/ca")
    assert status == 200 and d["holds_ca"] and d["node"] == member.node
    assert pki.cluster_id_of(pki.load_cert(d["ca"].encode())) == member.cluster_id
    status, d = post(member.port, "/v1/cluster/join", b"{" + b" " * 100_000 + b"}")
    assert status == 413 and d["error"]["code"] == "request_too_large"
    status, d = post(member.port, "/v1/cluster/join", b"{}")
    assert status == 400 and d["error"]["code"] == "bad_request"
    # revoke through the CLI: the agent serves the new list at once, and a member takes it
    before = member.get("/v1/cluster/revoked")[1]["version"]
    r = run_cli("cluster", "revoke", "0123456789ab", env=member.env)
    assert r.returncode == 0 and "revoked node 0123456789ab" in r.stdout
    status, d = member.get("/v1/cluster/revoked")
    assert status == 200 and d["version"] == before + 1
    assert "0123456789ab" in [e["node"] for e in d["entries"]]
    ca = pki.load_cert(member.get("/v1/cluster/ca")[1]["ca"].encode())
    assert revocation.from_json(d).check(ca).nodes >= {"0123456789ab"}
    # a revoked node cannot join again
    r = run_cli("cluster", "revoke", "0123456789ab", env=member.env)
    assert r.returncode == 0 and "already revoked" in r.stdout
    tok = tokens.parse_token(member.invite())
    status, d = post(member.port, "/v1/cluster/join", join_request(tok, "0123456789ab")[1])
    assert status == 403 and d["error"]["code"] == "node_revoked"
