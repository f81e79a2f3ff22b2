"""Join tokens (what ``cluster invite`` prints), durations, and the join protocol's MACs (pure).

A token is ``lsj1-`` followed by URL-safe base64 (no padding) of::

    cluster id (16 bytes) | token id (8 bytes) | secret (16 bytes) | address (UTF-8) | check (4 bytes)

where the address is ``host:port`` of a CA holder's agent data port (``[v6]:port`` for IPv6)
and the check is the first 4 bytes of SHA-256 of ``lsj1-`` and everything before it (it catches
a token damaged in copying before any network traffic).

The secret never leaves the joiner. Both sides use ``key = SHA-256("lakeshard-join-v1" 0x00 ||
secret)`` (:func:`join_key`), which is also all the CA holder stores: the proof of the token is
``HMAC-SHA256(key, token id || CSR DER || nonce)`` (:func:`proof`) and the member's answer
carries ``HMAC-SHA256(key, nonce || certificate DER)`` (:func:`response_mac`). A listener
sees a MAC over data it already has, which does not reveal the secret (128 bits, far out of
reach of guessing), and a MAC bound to the joiner's own CSR is of no use for another key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from agent.security import pki
from agent.security.errors import SecurityError

PREFIX = "lsj1-"
SECRET_BYTES = 16
TOKEN_ID_BYTES = 8
NONCE_BYTES = 16
CHECK_BYTES = 4
MAX_ADDRESS = 262  # a 253-character host name, ':' and a port
MAX_TOKEN = len(PREFIX) + 4 * (16 + TOKEN_ID_BYTES + SECRET_BYTES + MAX_ADDRESS + CHECK_BYTES) // 3 + 4
HOST_RE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\])$")
B64_RE = re.compile(r"^[A-Za-z0-9_-]*$")
DURATION_RE = re.compile(r"^(\d{1,7})([smhdw])$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_DURATION_S = 365 * 86400
MAX_USES = 1000


@dataclass(frozen=True)
class JoinToken:
    address: str  # host:port of a CA holder's agent
    cluster_id: str
    token_id: str  # 16 hex digits
    secret: bytes  # 16 bytes

    def encode(self) -> str:
        raw = pki.cluster_id_bytes(self.cluster_id) + bytes.fromhex(self.token_id) + self.secret
        raw += self.address.encode()
        raw += _check(raw)
        return PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @property
    def key(self) -> bytes:
        return join_key(self.secret)


def new_token(address: str, cluster_id: str) -> JoinToken:
    check_address(address)
    return JoinToken(address, cluster_id, secrets.token_hex(TOKEN_ID_BYTES), secrets.token_bytes(SECRET_BYTES))


def _check(raw: bytes) -> bytes:
    return hashlib.sha256(PREFIX.encode() + raw).digest()[:CHECK_BYTES]


def parse_token(text: str) -> JoinToken:
    """A token from what the user pasted; :class:`SecurityError` (one line) if it is not one."""
    t = text.strip()
    if not t.startswith(PREFIX):
        raise SecurityError(f"not a lakeshard join token (a token starts with {PREFIX})")
    body = t[len(PREFIX) :]
    if len(t) > MAX_TOKEN:
        raise SecurityError("the join token is too long: copy it again")
    try:
        if not B64_RE.match(body):
            raise ValueError(body)
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError):
        raise SecurityError("the join token is damaged (not base64): copy it again") from None
    fixed = 16 + TOKEN_ID_BYTES + SECRET_BYTES
    if len(raw) < fixed + 3 + CHECK_BYTES:
        raise SecurityError("the join token is too short: copy all of it")
    if not hmac.compare_digest(raw[-CHECK_BYTES:], _check(raw[:-CHECK_BYTES])):
        raise SecurityError("the join token is damaged (its check does not match): copy it again")
    cluster = pki.cluster_id_from_bytes(raw[:16])
    tid = raw[16 : 16 + TOKEN_ID_BYTES].hex()
    secret = raw[16 + TOKEN_ID_BYTES : fixed]
    try:
        address = raw[fixed:-CHECK_BYTES].decode()
    except UnicodeDecodeError:
        raise SecurityError("the join token's address is not text") from None
    check_address(address)
    return JoinToken(address, cluster, tid, secret)


def check_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) split, or :class:`SecurityError`."""
    host, sep, port = address.rpartition(":")
    if not sep or len(address) > MAX_ADDRESS or not HOST_RE.match(host):
        raise SecurityError(f"{address!r} is not host:port")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise SecurityError(f"{address!r} has no valid port")
    return host.strip("[]"), int(port)


def parse_duration(text: str) -> int:
    """Seconds in ``30s``, ``30m``, ``24h``, ``7d`` or ``2w`` (1 s to 365 days)."""
    m = DURATION_RE.match(text.strip().lower())
    if not m:
        raise SecurityError(f"{text!r} is not a duration: use a number and s, m, h, d or w (30m, 24h, 7d)")
    s = int(m[1]) * UNITS[m[2]]
    if not 1 <= s <= MAX_DURATION_S:
        raise SecurityError(f"{text!r}: a token lasts between 1s and 365d")
    return s


def parse_uses(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise SecurityError(f"{text!r} is not a number of uses") from None
    if not 1 <= n <= MAX_USES:
        raise SecurityError(f"uses must be between 1 and {MAX_USES}, not {n}")
    return n


def join_key(secret: bytes) -> bytes:
    """The key both sides derive from the token's secret (and all that the CA holder keeps)."""
    return hashlib.sha256(b"lakeshard-join-v1\x00" + secret).digest()


def proof(key: bytes, token_id: str, csr_der: bytes, nonce: bytes) -> bytes:
    """The joiner's proof that it holds the token (fixed-length token id and nonce around the CSR)."""
    return hmac.new(key, bytes.fromhex(token_id) + csr_der + nonce, hashlib.sha256).digest()


def response_mac(key: bytes, nonce: bytes, cert_der: bytes) -> bytes:
    """The member's proof that it knows the token too, bound to the certificate it answers with."""
    return hmac.new(key, nonce + cert_der, hashlib.sha256).digest()
