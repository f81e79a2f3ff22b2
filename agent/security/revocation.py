"""The revocation list: node ids the cluster no longer accepts, signed by the CA key.

``revoked.json``::

    {"cluster": "<cluster id>", "version": 3,
     "entries": [{"node": "3f2a9c1d0b7e", "at": 1767225600}],
     "signature": "<base64 of the CA key's ECDSA signature over the canonical body>"}

The canonical body is the JSON of ``{"cluster", "version", "entries"}`` with sorted keys and no
spaces. Any member can check a list it is handed by anyone against its CA certificate, so lists
may travel by gossip; a member keeps the highest valid version (:func:`newer`). Revoking a node
id refuses every certificate naming it, whatever its serial.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from dataclasses import dataclass
from typing import Any

from cryptography import x509

from agent.security import pki
from agent.security.errors import SecurityError

MAX_ENTRIES = 10_000
MAX_BYTES = 1024 * 1024  # what a list may take on the wire


@dataclass(frozen=True)
class Revoked:
    node: str
    at: int  # when it was revoked (Unix seconds)


@dataclass(frozen=True)
class RevocationList:
    cluster: str
    version: int
    entries: tuple[Revoked, ...]
    signature: bytes

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset(e.node for e in self.entries)

    def body(self) -> bytes:
        return _body(self.cluster, self.version, self.entries)

    def to_json(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "version": self.version,
            "entries": [{"node": e.node, "at": e.at} for e in self.entries],
            "signature": base64.b64encode(self.signature).decode(),
        }

    def check(self, ca_cert: x509.Certificate) -> RevocationList:
        """This list, once it is for ``ca_cert``'s cluster and signed by that CA."""
        if self.cluster != pki.cluster_id_of(ca_cert):
            raise SecurityError(f"the revocation list is for cluster {self.cluster}, not this one")
        if not pki.signature_ok(ca_cert, self.body(), self.signature):
            raise SecurityError("the revocation list's signature is not the cluster CA's")
        return self


def _body(cluster: str, version: int, entries: tuple[Revoked, ...]) -> bytes:
    d = {"cluster": cluster, "version": version, "entries": [{"node": e.node, "at": e.at} for e in entries]}
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def from_json(d: Any) -> RevocationList:
    """A list from its JSON form (shape only: :meth:`RevocationList.check` checks the signature)."""
    if not isinstance(d, dict):
        raise SecurityError("the revocation list is not a JSON object")
    cluster, version, entries, sig = d.get("cluster"), d.get("version"), d.get("entries"), d.get("signature")
    if not isinstance(cluster, str) or not pki.CLUSTER_ID_RE.match(cluster):
        raise SecurityError("the revocation list names no cluster")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise SecurityError("the revocation list has no version number")
    if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
        raise SecurityError("the revocation list's entries are not a list")
    out = []
    for e in entries:
        node, at = (e.get("node"), e.get("at")) if isinstance(e, dict) else (None, None)
        if (
            not isinstance(node, str)
            or not pki.NODE_ID_RE.match(node)
            or isinstance(at, bool)
            or not isinstance(at, int)
        ):
            raise SecurityError("the revocation list holds an entry that is not {node, at}")
        out.append(Revoked(node, at))
    if not isinstance(sig, str) or len(sig) > 256:
        raise SecurityError("the revocation list is not signed")
    try:
        raw = base64.b64decode(sig, validate=True)
    except (binascii.Error, ValueError):
        raise SecurityError("the revocation list's signature is not base64") from None
    return RevocationList(cluster, version, tuple(out), raw)


def parse(data: bytes, ca_cert: x509.Certificate) -> RevocationList:
    """A list from bytes handed over by anyone, checked against ``ca_cert``."""
    if len(data) > MAX_BYTES:
        raise SecurityError("the revocation list is too large")
    try:
        d = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise SecurityError("the revocation list is not JSON") from None
    return from_json(d).check(ca_cert)


def signed(
    ca_key: pki.PrivateKey, ca_cert: x509.Certificate, version: int, entries: tuple[Revoked, ...]
) -> RevocationList:
    cluster = pki.cluster_id_of(ca_cert)
    return RevocationList(cluster, version, entries, pki.sign(ca_key, _body(cluster, version, entries)))


def empty(ca_key: pki.PrivateKey, ca_cert: x509.Certificate) -> RevocationList:
    """Version 0: nobody revoked (what a new CA starts with)."""
    return signed(ca_key, ca_cert, 0, ())


def add(
    rl: RevocationList, ca_key: pki.PrivateKey, ca_cert: x509.Certificate, node: str, at: int | None = None
) -> RevocationList:
    """``rl`` with ``node`` revoked, as the next version (unchanged if it is revoked already)."""
    if not pki.NODE_ID_RE.match(node):
        raise SecurityError(f"{node!r} is not a node id (12 hex digits)")
    if node in rl.nodes:
        return rl
    entry = Revoked(node, int(time.time()) if at is None else at)
    return signed(ca_key, ca_cert, rl.version + 1, (*rl.entries, entry))


def newer(current: RevocationList | None, offered: RevocationList, ca_cert: x509.Certificate) -> bool:
    """Whether a member holding ``current`` should adopt ``offered``: validly signed by its CA
    and of a higher version. A list that fails the check raises :class:`SecurityError`."""
    offered.check(ca_cert)
    return current is None or offered.version > current.version
