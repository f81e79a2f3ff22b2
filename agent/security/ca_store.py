"""What only a CA holder keeps beside ``ca.key``: its outstanding invites and the certificates it issued.

``invites.json`` (0600)::

    {"invites": {"<token id>": {"key": "<hex of join_key(secret)>", "expires": 1767225600.0,
                                "uses": 1, "created": 1767139200.0}}}

The secret itself is never stored (see :mod:`agent.security.tokens`). An invite that is used up
or expired stays a week, so that a late attempt is told which it is; then it goes.

``issued.json`` (0600): for each node id, the SHA-256 of the public key its certificate was
issued for. A node id already issued for one key is not issued for another: a token holder
cannot take over an existing member's identity (the same key may renew its certificate).

Every read-modify-write happens under the folder's lock, and the check that an invite has uses
left and the decrement are one step (:func:`spend`): two concurrent joins cannot both spend the
last use.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from agent.security import files
from agent.security.errors import SecurityError
from agent.security.tokens import JoinToken

KEEP_S = 7 * 86400
ISSUED = "issued.json"


class Refused(SecurityError):
    """A join the CA holder refuses: an HTTP status and a code the joiner turns into a message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class Invite:
    token_id: str
    key: bytes
    expires: float
    uses: int
    created: float


def _load(folder: Path) -> dict[str, Invite]:
    try:
        d = files.read_json(folder / files.INVITES)
    except ValueError as e:
        raise SecurityError(f"{folder / files.INVITES} is damaged: {e}") from None
    out: dict[str, Invite] = {}
    for tid, v in ((d or {}).get("invites") or {}).items():
        try:
            out[tid] = Invite(tid, bytes.fromhex(v["key"]), float(v["expires"]), int(v["uses"]), float(v["created"]))
        except (KeyError, TypeError, ValueError):
            continue  # a damaged entry: that token is unknown
    return out


def _save(folder: Path, invites: dict[str, Invite], now: float) -> None:
    keep = {
        i.token_id: {"key": i.key.hex(), "expires": i.expires, "uses": i.uses, "created": i.created}
        for i in invites.values()
        if now - i.expires < KEEP_S
    }
    files.write_json(folder / files.INVITES, {"invites": keep}, private=True)


def add(folder: Path, token: JoinToken, expires_s: float, uses: int, now: float | None = None) -> Invite:
    t = time.time() if now is None else now
    inv = Invite(token.token_id, token.key, t + expires_s, uses, t)
    with files.locked(folder):
        invites = _load(folder)
        invites[inv.token_id] = inv
        _save(folder, invites, t)
    return inv


def _usable(invites: dict[str, Invite], token_id: str, now: float) -> Invite:
    inv = invites.get(token_id)
    if inv is None:
        raise Refused(403, "token_unknown", "this node made no such join token (or it was forgotten long ago)")
    if inv.uses <= 0:
        raise Refused(410, "token_used", "the join token has already been used")
    if now >= inv.expires:
        raise Refused(410, "token_expired", "the join token has expired")
    return inv


def check(folder: Path, token_id: str, now: float | None = None) -> Invite:
    """The invite ``token_id`` if it can still be used; :class:`Refused` otherwise."""
    return _usable(_load(folder), token_id, time.time() if now is None else now)


def spend(folder: Path, token_id: str, now: float | None = None) -> Invite:
    """Take one use of ``token_id`` (checked again under the lock)."""
    t = time.time() if now is None else now
    with files.locked(folder):
        invites = _load(folder)
        inv = _usable(invites, token_id, t)
        invites[token_id] = Invite(inv.token_id, inv.key, inv.expires, inv.uses - 1, inv.created)
        _save(folder, invites, t)
    return inv


def outstanding(folder: Path, now: float | None = None) -> int:
    """How many invites can still be used."""
    t = time.time() if now is None else now
    return sum(1 for i in _load(folder).values() if i.uses > 0 and t < i.expires)


def key_hash(pub: ec.EllipticCurvePublicKey) -> str:
    der = pub.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def _issued(folder: Path) -> dict[str, Any]:
    try:
        d = files.read_json(folder / ISSUED)
    except ValueError as e:
        raise SecurityError(f"{folder / ISSUED} is damaged: {e}") from None
    return d if isinstance(d, dict) else {}


def check_claim(folder: Path, node: str, pub: ec.EllipticCurvePublicKey) -> None:
    """:class:`Refused` if ``node``'s certificate was issued for another key than ``pub``."""
    old = _issued(folder).get(node)
    if isinstance(old, dict) and old.get("key") != key_hash(pub):
        raise Refused(
            409,
            "node_taken",
            f"node id {node} is already a member with another key; a new machine needs its own node id",
        )


def claim(folder: Path, node: str, pub: ec.EllipticCurvePublicKey, serial: int, now: float | None = None) -> None:
    """Record that ``node``'s certificate (``serial``) is issued for ``pub`` (checked again under the lock)."""
    with files.locked(folder):
        check_claim(folder, node, pub)
        d = _issued(folder)
        d[node] = {"key": key_hash(pub), "serial": f"{serial:x}", "at": time.time() if now is None else now}
        files.write_json(folder / ISSUED, d, private=True)


def issued_count(folder: Path) -> int:
    return len(_issued(folder))
