"""The join protocol, both ends.

The joiner (:func:`join_cluster`), holding a token (:mod:`agent.security.tokens`):

1. ``GET http://ADDRESS/v1/cluster/ca``: the member's CA certificate (public; plain HTTP). Its
   fingerprint must be the cluster id the token names, or the joiner stops here, having sent
   nothing derived from the secret (a man in the middle cannot put its own CA in its place).
2. It makes its key pair (the private key never leaves it) and a CSR for ``CN=<node id>``, and
   ``POST /v1/cluster/join`` ``{"token": id, "csr": PEM, "nonce": hex, "proof": hex}`` with
   ``proof = HMAC(key, token id || CSR DER || nonce)``.
3. The answer ``{"cert", "ca", "revoked", "mac", "signed_by"}`` is taken only when ``mac =
   HMAC(key, nonce || cert DER)``, the certificate is the CA's, for its own key and node id, the
   CA is the one it checked, and the revocation list is signed by it. Only then is anything stored.

The member (:func:`answer_join`, a CA holder) checks in this order: the token (known, uses
left, not expired: 403/410), the proof (constant-time), the CSR (signature, P-256, a node id,
not revoked, not another member's id), then spends one use and signs.
"""

from __future__ import annotations

import hmac
import http.client
import json
import secrets
import socket
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from agent.security import ca_store, files, pki, revocation, tokens
from agent.security.ca_store import Refused
from agent.security.credentials import Credentials
from agent.security.errors import JoinError, SecurityError
from agent.security.tokens import JoinToken

MAX_BODY = 64 * 1024  # a join request (a CSR is under 1 KB)
MAX_ANSWER = 2 * 1024 * 1024  # a join answer (the revocation list may be long)


# -- the member ----------------------------------------------------------------------------------
def _field(d: dict[str, Any], key: str, hex_bytes: int | None = None, limit: int = pki.MAX_PEM) -> str:
    v = d.get(key)
    if not isinstance(v, str) or len(v) > limit:
        raise Refused(400, "bad_request", f"the join request has no valid {key!r}")
    if hex_bytes is not None:
        try:
            if len(bytes.fromhex(v)) != hex_bytes:
                raise ValueError
        except ValueError:
            raise Refused(400, "bad_request", f"{key!r} must be {hex_bytes * 2} hex digits") from None
    return v


def answer_join(creds: Credentials, body: bytes, now: float | None = None) -> dict[str, Any]:
    """The answer to a join request ``body``; :class:`Refused` (status, code, message) otherwise."""
    if creds.ca_key is None:
        raise Refused(404, "not_ca_holder", not_holder_message(creds))
    if len(body) > MAX_BODY:
        raise Refused(413, "request_too_large", f"a join request is at most {MAX_BODY} bytes")
    try:
        d = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise Refused(400, "bad_request", "the join request is not JSON") from None
    if not isinstance(d, dict):
        raise Refused(400, "bad_request", "the join request is not a JSON object")
    tid = _field(d, "token", tokens.TOKEN_ID_BYTES)
    nonce = bytes.fromhex(_field(d, "nonce", tokens.NONCE_BYTES))
    proof = bytes.fromhex(_field(d, "proof", 32))
    csr_text = _field(d, "csr")
    folder = creds.folder
    inv = ca_store.check(folder, tid, now)
    try:
        csr = pki.load_csr(csr_text.encode())
    except SecurityError as e:
        raise Refused(400, "bad_csr", str(e)) from None
    if not hmac.compare_digest(tokens.proof(inv.key, tid, pki.csr_der(csr), nonce), proof):
        raise Refused(403, "bad_proof", "the proof does not match the token (its secret is wrong)")
    try:
        node = pki.check_csr(csr)
    except SecurityError as e:
        raise Refused(400, "bad_csr", str(e)) from None
    if creds.is_revoked(node):
        raise Refused(403, "node_revoked", f"node {node} is revoked in this cluster")
    pub = csr.public_key()
    assert isinstance(pub, ec.EllipticCurvePublicKey)  # check_csr made sure
    ca_store.check_claim(folder, node, pub)
    ca_store.spend(folder, tid, now)
    cert = pki.issue(creds.ca_key, creds.ca_cert, csr)
    ca_store.claim(folder, node, pub, cert.serial_number)
    der = pki.cert_der(cert)
    return {
        "cluster": creds.cluster_id,
        "node": node,
        "cert": pki.cert_pem(cert).decode(),
        "ca": pki.cert_pem(creds.ca_cert).decode(),
        "revoked": creds.revoked.to_json() if creds.revoked is not None else None,
        "mac": tokens.response_mac(inv.key, nonce, der).hex(),
        "signed_by": creds.node_id,
    }


def not_holder_message(creds: Credentials) -> str:
    signer = member_info(creds.folder).get("signed_by")
    who = f"; node {signer} signed its certificate and may hold it" if isinstance(signer, str) else ""
    return f"node {creds.node_id} does not hold the cluster's CA and cannot sign certificates{who}"


def member_info(folder: Path) -> dict[str, Any]:
    """``member.json``: how this node joined (empty for a CA holder that made the cluster)."""
    try:
        d = files.read_json(folder / files.MEMBER)
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


# -- the joiner ----------------------------------------------------------------------------------
REFUSALS = {
    "token_unknown": "the member at {addr} does not know this join token (another CA holder made it, or the "
    "cluster was made again): ask for a new one",
    "token_used": "the join token has already been used: ask for a new one ('lakeshard cluster invite')",
    "token_expired": "the join token has expired: ask for a new one ('lakeshard cluster invite')",
    "bad_proof": "the member refused the token's proof: its secret is wrong (copy the whole token again)",
    "node_revoked": "this node is revoked in the cluster: its administrator must make it a new node id",
}


def _join_tls() -> ssl.SSLContext:
    """TLS towards a secure agent's port before this node has a certificate or trusts the CA.
    It does not check the agent's certificate: the join protocol authenticates both ends itself
    (the CA's fingerprint against the token, then the MACs), as it does over plain HTTP."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _http(url: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, dict[str, Any]]:
    """GET (or POST ``body`` as JSON) straight to ``url`` (never through a proxy): status and JSON."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=_join_tls())
    )
    try:
        with opener.open(req, timeout=timeout) as r:
            status, raw = r.status, r.read(MAX_ANSWER + 1)
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read(MAX_ANSWER + 1)
    if len(raw) > MAX_ANSWER:
        raise JoinError(f"{url} answered with more than {MAX_ANSWER} bytes")
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise JoinError(f"{url} did not answer as a lakeshard agent (HTTP {status}, not JSON)") from None
    if not isinstance(d, dict):
        raise JoinError(f"{url} did not answer as a lakeshard agent (HTTP {status})")
    return status, d


def _error(d: dict[str, Any]) -> tuple[str, str]:
    e = d.get("error")
    if isinstance(e, dict):
        return str(e.get("code") or ""), str(e.get("message") or "")[:300]
    return "", str(e or "")[:300]


def _get_ca(address: str, timeout: float) -> tuple[str, int, dict[str, Any]]:
    """``GET /v1/cluster/ca``: the base URL that answered, its status and JSON. TLS first (an agent
    with credentials serves only TLS), then plain HTTP (an agent started with --insecure)."""
    try:
        return f"https://{address}", *_http(f"https://{address}/v1/cluster/ca", None, timeout)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        if isinstance(reason, ConnectionRefusedError | TimeoutError | socket.gaierror):
            raise
    return f"http://{address}", *_http(f"http://{address}/v1/cluster/ca", None, timeout)


def fetch_ca(address: str, timeout: float = 10.0) -> x509.Certificate:
    """The CA certificate the agent at ``address`` shows (``GET /v1/cluster/ca``)."""
    return _fetch_ca(address, timeout)[1]


def _fetch_ca(address: str, timeout: float = 10.0) -> tuple[str, x509.Certificate]:
    try:
        base, status, d = _get_ca(address, timeout)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise JoinError(f"cannot reach the cluster member at {address} ({reason})") from None
    if status != 200:
        raise JoinError(f"the agent at {address} shows no cluster CA: {_error(d)[1] or f'HTTP {status}'}")
    pem = d.get("ca")
    if not isinstance(pem, str):
        raise JoinError(f"the agent at {address} answered without a CA certificate")
    try:
        return base, pki.load_cert(pem.encode())
    except SecurityError as e:
        raise JoinError(f"the agent at {address} shows a CA certificate that does not parse: {e}") from None


def join_cluster(
    token: JoinToken | str, node: str, folder: Path | None = None, *, force: bool = False, timeout: float = 10.0
) -> Credentials:
    """Join the cluster ``token`` names as ``node``; the new credentials (stored in ``folder``).
    Every failure is a :class:`JoinError` or :class:`SecurityError` with a one-line message."""
    tok = tokens.parse_token(token) if isinstance(token, str) else token
    d = files.security_dir(folder)
    if (d / files.CA_KEY).exists():
        raise JoinError(f"this node holds a cluster CA ({d / files.CA_KEY}): it cannot join another cluster")
    if (d / files.NODE_CERT).exists() and not force:
        raise JoinError("this node is already in a cluster ('lakeshard cluster status'); --force joins another")
    addr = tok.address
    base, ca = _fetch_ca(addr, timeout)
    seen = pki.cluster_id_of(ca)
    if not hmac.compare_digest(seen, tok.cluster_id):
        raise JoinError(
            f"the agent at {addr} shows the CA of cluster {seen}, but the token names cluster {tok.cluster_id}: "
            "refusing to join (another cluster, or someone in between)"
        )
    key = pki.new_key()
    csr = pki.make_csr(key, node)
    nonce = secrets.token_bytes(tokens.NONCE_BYTES)
    proof = tokens.proof(tok.key, tok.token_id, pki.csr_der(csr), nonce)
    body = {"token": tok.token_id, "csr": pki.csr_pem(csr).decode(), "nonce": nonce.hex(), "proof": proof.hex()}
    try:
        status, ans = _http(f"{base}/v1/cluster/join", body, timeout)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise JoinError(f"cannot reach the cluster member at {addr} ({getattr(e, 'reason', None) or e})") from None
    if status != 200:
        code, msg = _error(ans)
        raise JoinError(REFUSALS.get(code, "the member at {addr} refused: {msg}").format(addr=addr, msg=msg or status))
    cert, rl = _check_answer(ans, tok, nonce, ca, key, node)
    files.write_private(d / files.NODE_KEY, pki.key_pem(key))
    files.write_public(d / files.CA_CERT, pki.cert_pem(ca))
    if rl is not None:
        files.write_json(d / files.REVOKED, rl.to_json())
    else:
        (d / files.REVOKED).unlink(missing_ok=True)
    signer = ans.get("signed_by")
    info = {"cluster": tok.cluster_id, "node": node, "address": addr, "joined": time.time()}
    files.write_json(d / files.MEMBER, {**info, "signed_by": signer if isinstance(signer, str) else None})
    files.write_public(d / files.NODE_CERT, pki.cert_pem(cert))  # last: its presence makes a member
    return Credentials.load(d)


def _check_answer(
    ans: dict[str, Any], tok: JoinToken, nonce: bytes, ca: x509.Certificate, key: pki.PrivateKey, node: str
) -> tuple[x509.Certificate, revocation.RevocationList | None]:
    """The certificate and revocation list of a join answer, once every check passes."""
    where = f"the member at {tok.address}"
    cert_text, ca_text, mac = ans.get("cert"), ans.get("ca"), ans.get("mac")
    if not isinstance(cert_text, str) or not isinstance(ca_text, str) or not isinstance(mac, str):
        raise JoinError(f"{where} answered without a certificate")
    try:
        cert, ca2 = pki.load_cert(cert_text.encode()), pki.load_cert(ca_text.encode())
        mac_ok = hmac.compare_digest(bytes.fromhex(mac), tokens.response_mac(tok.key, nonce, pki.cert_der(cert)))
    except (SecurityError, ValueError) as e:
        raise JoinError(f"{where} answered with a certificate that does not parse: {e}") from None
    if not mac_ok:
        raise JoinError(f"{where} does not know the token's secret (its answer's MAC is wrong): refusing its answer")
    if pki.cert_der(ca2) != pki.cert_der(ca):
        raise JoinError(f"{where} answered with another CA than the one it showed")
    try:
        if pki.check_node_cert(cert, ca) != node or cert.public_key() != key.public_key():
            raise SecurityError("it is not for this node's key and id")
        rl = revocation.from_json(ans["revoked"]).check(ca) if ans.get("revoked") is not None else None
    except SecurityError as e:
        raise JoinError(f"{where} answered with a certificate this node cannot use: {e}") from None
    return cert, rl
