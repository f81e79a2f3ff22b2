"""The cluster operations the CLI (``lakeshard cluster ...``) and the tray's settings call.

* :func:`init_cluster`: a new CA here, and this node's own certificate (a CA holder is a member);
* :func:`invite`: a join token for the CA holder's agent at ``address``;
* :func:`join_cluster` (from :mod:`agent.security.join`): become a member with a token;
* :func:`revoke`: add a node id to the signed revocation list;
* :func:`status`: what this node holds.

Each takes ``folder`` (default: ``config_dir()/security``) and raises
:class:`~agent.security.errors.SecurityError` with a one-line message.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from agent.security import ca_store, files, pki, revocation, tokens
from agent.security.credentials import Credentials, NotMember
from agent.security.errors import SecurityError
from agent.security.join import join_cluster, member_info
from agent.security.revocation import RevocationList

__all__ = ["init_cluster", "invite", "join_cluster", "revoke", "status"]
EVERYTHING = (
    files.CA_KEY,
    files.CA_CERT,
    files.NODE_KEY,
    files.NODE_CERT,
    files.REVOKED,
    files.INVITES,
    files.MEMBER,
    ca_store.ISSUED,
)


def init_cluster(node: str, folder: Path | None = None, *, force: bool = False) -> Credentials:
    """Make a new cluster: its CA (``ca.key`` 0600, ``ca.crt``), a signed empty revocation list,
    and this node's key and certificate. Refuses to replace existing credentials unless ``force``
    (then every member must join again: the cluster id changes)."""
    d = files.security_dir(folder)
    had = [n for n in (files.CA_KEY, files.CA_CERT, files.NODE_CERT) if (d / n).exists()]
    if had and not force:
        what = _cluster_here(d)
        raise SecurityError(
            f"this node already has cluster credentials ({what}, {d}); --force makes a new cluster and every "
            "member must join it again"
        )
    ca_key, ca_cert = pki.make_ca()
    node_key = pki.new_key()
    cert = pki.issue(ca_key, ca_cert, pki.make_csr(node_key, node))
    with files.locked(d):
        for name in EVERYTHING:
            (d / name).unlink(missing_ok=True)
        files.write_private(d / files.CA_KEY, pki.key_pem(ca_key))
        files.write_public(d / files.CA_CERT, pki.cert_pem(ca_cert))
        files.write_private(d / files.NODE_KEY, pki.key_pem(node_key))
        files.write_json(d / files.REVOKED, revocation.empty(ca_key, ca_cert).to_json())
    ca_store.claim(d, node, node_key.public_key(), cert.serial_number)
    files.write_public(d / files.NODE_CERT, pki.cert_pem(cert))
    return Credentials.load(d)


def _cluster_here(d: Path) -> str:
    try:
        return f"cluster {pki.cluster_id_of(pki.load_cert((d / files.CA_CERT).read_bytes()))}"
    except (OSError, SecurityError):
        return "a damaged cluster CA"


def ca_holder(folder: Path | None = None) -> Credentials:
    """This node's credentials, when it holds the CA; :class:`SecurityError` otherwise."""
    creds = Credentials.load(folder)
    if not creds.holds_ca:
        signer = member_info(creds.folder).get("signed_by")
        where = f" (node {signer} signed this node's certificate)" if isinstance(signer, str) else ""
        raise SecurityError(f"only a node that holds the cluster CA can do this; this one does not{where}")
    return creds


def invite(address: str, expires_s: float, uses: int, folder: Path | None = None, now: float | None = None) -> str:
    """A join token for the CA holder's agent at ``address`` (host:port of its data port),
    usable ``uses`` times within ``expires_s`` seconds. Only a hash-derived key is stored."""
    if not 0 < expires_s <= tokens.MAX_DURATION_S:
        raise SecurityError("a token lasts between 1s and 365d")
    if not 1 <= uses <= tokens.MAX_USES:
        raise SecurityError(f"uses must be between 1 and {tokens.MAX_USES}")
    creds = ca_holder(folder)
    tok = tokens.new_token(address, creds.cluster_id)
    ca_store.add(creds.folder, tok, expires_s, uses, now)
    return tok.encode()


def revoke(node: str, folder: Path | None = None) -> RevocationList:
    """Add ``node`` to the revocation list (a new version, signed by the CA key)."""
    if not pki.NODE_ID_RE.match(node):
        raise SecurityError(f"{node!r} is not a node id (12 hex digits; 'lakeshard status' lists them)")
    creds = ca_holder(folder)
    if node == creds.node_id:
        raise SecurityError("a node cannot revoke itself (it holds the CA: make a new cluster with 'init --force')")
    assert creds.ca_key is not None
    with files.locked(creds.folder):
        creds.refresh()
        current = creds.revoked or revocation.empty(creds.ca_key, creds.ca_cert)
        rl = revocation.add(current, creds.ca_key, creds.ca_cert, node)
        if rl is not current:
            files.write_json(creds.folder / files.REVOKED, rl.to_json())
    return rl


def status(folder: Path | None = None) -> dict[str, Any]:
    """What this node holds: cluster id, node id, CA or not, certificate expiry, revocations."""
    try:
        creds = Credentials.load(folder)
    except NotMember:
        return {"member": False, "folder": str(files.security_path(folder))}
    d = creds.folder
    out: dict[str, Any] = {
        "member": True,
        "cluster_id": creds.cluster_id,
        "node_id": creds.node_id,
        "holds_ca": creds.holds_ca,
        "cert_expires": creds.expires.isoformat(),
        "cert_days_left": int((creds.expires.timestamp() - time.time()) // 86400),
        "revoked": sorted(creds.revoked.nodes) if creds.revoked else [],
        "revocation_version": creds.revocation_version,
        "folder": str(d),
    }
    info = member_info(d)
    if info.get("signed_by"):
        out["signed_by"] = info["signed_by"]
    if creds.holds_ca:
        out["invites_open"] = ca_store.outstanding(d)
        out["issued"] = ca_store.issued_count(d)
    return out
