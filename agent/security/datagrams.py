"""Election datagrams: signed and checked with the cluster's certificates, or plaintext.

The elector (:mod:`agent.cluster.elector`) hands every outgoing control message to :meth:`seal` and
every datagram it receives to :meth:`open`; which codec it uses is chosen once, from the node's
credentials (:func:`for_credentials`):

* :class:`Plain` (no credentials, or ``--insecure``): today's frames, unsigned. A signed datagram
  (a :class:`~agent.protocol.Sealed` envelope) is refused as ``signed``: it comes from a cluster
  with credentials, which a plaintext node is not part of.
* :class:`Signed`: every message travels in a :class:`~agent.protocol.Sealed` envelope signed
  with this node's key (ECDSA P-256, about 25 us to sign and 65 us to check here). The envelope
  names the sender's certificate by the first 16 bytes of its SHA-256 and carries the whole
  certificate (480 bytes of DER) only in some datagrams: the first to each address, every
  ``CERT_EVERY``-th after, every one to an address this node has not heard a valid datagram from
  lately, and every vote and vote request (elections must not wait). A receiver checks a
  certificate once (this cluster's CA, valid now, a node certificate) and keeps it by that name.
  A beat is sealed once per round (one stamp, one signature) for every peer; a reply (ack, vote)
  or a vote request names the node it is for (``to``), which must be the receiver.
  A beat is then about 500 bytes, and about 1 KB with the certificate (1.2 KB at most: a beat that
  offers 8 devices): one datagram, under a 1400-byte MTU. A beat also says which revocation
  list version its sender holds (:meth:`Datagrams.revocation_version`, a few bytes): members
  that hold an older one fetch the newer list (:mod:`agent.cluster.revocation_gossip`).

What :class:`Signed` refuses (each counted by code, the first of each code every ``LOG_EVERY_S``
logged as a WARNING): ``unsigned`` (a plain frame), ``other_cluster`` (the envelope names another
cluster), ``other_ca`` (the certificate is not signed by this cluster's CA), ``bad_cert`` (not a
node certificate of this cluster, or not valid now), ``revoked`` (the revocation list names the
node; the list is re-read from disk every ``REFRESH_S``), ``wrong_node`` (the envelope, or the
message inside it, claims another node id than the certificate's CN), ``wrong_recipient`` (sealed
for another node), ``bad_signature``,
``unknown_cert`` (a short name not learnt yet and no certificate: normal for a second after a
peer appears; logged at INFO), ``stale`` (stamped more than ``WINDOW_S`` away from this node's
clock: a replay, or a clock that is far off), ``replay`` (a stamp not above the last one accepted
from that node) and ``stale_term`` (a term below one that node already sent: terms only grow).

Replay protection: ``stamp`` is the sender's wall clock in microseconds, strictly increasing per
sender (across restarts too, as long as its clock does not jump back). A receiver remembers the
last stamp and term accepted from each node for ``WINDOW_S``; older datagrams fail the window, so a
recorded datagram is refused both while the receiver remembers its sender and after it forgets
(or restarts). The cost is that nodes' clocks must agree within ``WINDOW_S`` (office machines
keep network time; a node that is off says so in every refusal's log line).
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from agent.protocol import Ack, Beat, Message, ProtocolError, Sealed, Vote, VoteRequest, decode, encode
from agent.protocol.control import KEY_BYTES, seal_bytes
from agent.security import pki
from agent.security.credentials import Credentials
from agent.security.errors import SecurityError

log = logging.getLogger(__name__)
WINDOW_S = 60.0  # how far a datagram's stamp may be from this node's clock
CERT_EVERY = 4  # one datagram in this many to an address carries the certificate
KNOWN_S = 5.0  # an address heard from (validly) this recently has seen our certificate
REFRESH_S = 2.0  # how often the revocation list is re-read from disk
LOG_EVERY_S = 5.0  # one WARNING per refusal code in this long: a flood must not flood the log
MAX_CERTS = 1024  # certificates remembered (a cluster has far fewer nodes)
QUIET = frozenset({"unknown_cert"})  # refusals that are part of normal start-up


class Refused(Exception):
    """A datagram that is not taken: ``code`` says why (see the module's docstring)."""

    def __init__(self, code: str, why: str) -> None:
        super().__init__(why)
        self.code, self.why = code, why


def sender_term(msg: Message) -> int:
    """The term the sender of a control message was in when it sent it (it only grows)."""
    if isinstance(msg, Vote):
        return msg.voter_term
    if isinstance(msg, Beat | Ack | VoteRequest):
        return msg.term
    return 0


class Datagrams:
    """How election datagrams are sealed and opened; counts (and logs) what it refuses."""

    signed = False

    def __init__(self) -> None:
        self.refused: collections.Counter[str] = collections.Counter()
        self._logged: dict[str, float] = {}

    def describe(self) -> str:
        raise NotImplementedError

    def seal(self, msg: Message, addr: tuple[str, int]) -> bytes:
        """The datagram that carries ``msg`` to ``addr``."""
        raise NotImplementedError

    def open(self, data: bytes, src: tuple[str, int]) -> Message:
        """The control message a datagram from ``src`` carries; :class:`Refused` if it is not taken."""
        raise NotImplementedError

    def note(self, code: str, why: str) -> None:
        """Count a refused datagram; log the first of its kind every LOG_EVERY_S."""
        self.refused[code] += 1
        now = time.monotonic()
        if now - self._logged.get(code, float("-inf")) >= LOG_EVERY_S:
            self._logged[code] = now
            level = logging.INFO if code in QUIET else logging.WARNING
            log.log(level, "ignored: %s [%s, %d so far]", why, code, self.refused[code])

    def status(self) -> dict[str, Any]:
        return {"mode": "signed" if self.signed else "plaintext", "refused": dict(self.refused)}

    def revocation_version(self) -> int:
        """The version of the revocation list this node holds, as its beats carry it (-1: none)."""
        return -1


class Plain(Datagrams):
    """Unsigned election traffic (a node without credentials, or started ``--insecure``)."""

    def describe(self) -> str:
        return "plaintext (unsigned)"

    def seal(self, msg: Message, addr: tuple[str, int]) -> bytes:
        return encode(msg)

    def open(self, data: bytes, src: tuple[str, int]) -> Message:
        msg = _decode(data, src)
        if isinstance(msg, Sealed):
            raise Refused(
                "signed",
                f"a signed datagram from {src[0]} (node {msg.node}, cluster {msg.cluster}): this node has no "
                "cluster credentials, so it is not part of that cluster",
            )
        return msg


@dataclass(frozen=True)
class Known:
    """A certificate checked once: whose it is, its key and how long it is valid."""

    node: str
    public_key: ec.EllipticCurvePublicKey
    not_before: dt.datetime
    not_after: dt.datetime


class Signed(Datagrams):
    """Election traffic signed with this node's key and checked against the cluster's CA."""

    signed = True

    def __init__(self, creds: Credentials, window_s: float = WINDOW_S) -> None:
        super().__init__()
        self.creds, self.window_s = creds, window_s
        self._stamp = 0
        self._sent: dict[tuple[str, int], int] = {}  # datagrams sent to each address
        # address -> (when a valid datagram last came from it (monotonic), the node that sent it)
        self._heard: dict[tuple[str, int], tuple[float, str]] = {}
        self._beat: tuple[Message, Sealed] | None = None  # this round's beat, sealed once for every peer
        self.sent: collections.Counter[str] = collections.Counter()  # datagrams with and without the certificate
        self.largest: collections.Counter[str] = collections.Counter()  # the largest of each (bytes)
        self._certs: collections.OrderedDict[bytes, Known] = collections.OrderedDict()
        self._seen: dict[str, tuple[int, int]] = {}  # node -> (last stamp, highest term) accepted
        self._refreshed = time.monotonic()

    def describe(self) -> str:
        return f"signed (node {self.creds.node_id}, cluster {self.creds.cluster_id})"

    # -- sending ---------------------------------------------------------------------------------
    def seal(self, msg: Message, addr: tuple[str, int]) -> bytes:
        heard = self._heard.get(addr)
        if isinstance(msg, Beat):  # the same beat to every peer: one envelope (one stamp) for all
            if self._beat is None or self._beat[0] is not msg:
                self._beat = (msg, sealed(self.creds, msg, self._next_stamp()))
            env = self._beat[1]
        else:  # a reply or a vote request: for the node heard at that address
            env = sealed(self.creds, msg, self._next_stamp(), to=heard[1] if heard else None)
        n = self._sent[addr] = self._sent.get(addr, 0) + 1
        if len(self._sent) > MAX_CERTS:  # addresses come and go: start counting afresh
            self._sent = {addr: n}
        known = heard is not None and time.monotonic() - heard[0] < KNOWN_S
        full = isinstance(msg, Vote | VoteRequest) or n % CERT_EVERY == 1 or not known
        frame = encode(env if full else replace(env, cert=None))
        kind = "with_cert" if full else "lean"
        self.sent[kind] += 1
        self.largest[kind] = max(self.largest[kind], len(frame))
        return frame

    def _next_stamp(self) -> int:
        self._stamp = max(self._stamp + 1, time.time_ns() // 1000)
        return self._stamp

    # -- receiving -------------------------------------------------------------------------------
    def open(self, data: bytes, src: tuple[str, int]) -> Message:
        env = _decode(data, src)
        if not isinstance(env, Sealed):
            raise Refused("unsigned", f"an unsigned {env.TYPE!r} datagram from {src[0]}: this cluster signs its beats")
        who = f"{src[0]} (claims node {env.node})"
        if env.cluster != self.creds.cluster_id:
            raise Refused("other_cluster", f"{who} belongs to cluster {env.cluster!r}, not ours")
        known = self._certs.get(env.key) or self._learn(env, who)
        now = dt.datetime.now(dt.UTC)
        if not known.not_before <= now <= known.not_after:
            raise Refused("bad_cert", f"{who}: its certificate is not valid now")
        self._refresh()
        if self.creds.is_revoked(known.node):
            raise Refused("revoked", f"{who}: node {known.node} is revoked")
        if env.node != known.node:
            raise Refused("wrong_node", f"{who}: its certificate names node {known.node}")
        if env.to is not None and env.to != self.creds.node_id:
            raise Refused("wrong_recipient", f"{who}: sealed for node {env.to}, not this one")
        try:
            known.public_key.verify(env.sig, env.signed_bytes(), ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, ValueError):
            raise Refused("bad_signature", f"{who}: the signature is not node {known.node}'s") from None
        try:
            msg, _ = decode(env.body)
        except ProtocolError as e:
            raise Refused("malformed", f"{who}: the signed message is malformed: {e}") from None
        if getattr(msg, "node", None) != env.node or getattr(msg, "cluster", None) != env.cluster:
            raise Refused("wrong_node", f"{who}: the signed {msg.TYPE!r} speaks for another node or cluster")
        self._check_fresh(env, sender_term(msg), who)
        self._heard[src] = (time.monotonic(), env.node)
        if len(self._heard) > MAX_CERTS:
            self._heard = {src: self._heard[src]}
        return msg

    def _learn(self, env: Sealed, who: str) -> Known:
        """The certificate an envelope names, checked (and kept) the first time it comes."""
        if env.cert is None:
            raise Refused("unknown_cert", f"{who}: its certificate is not known here yet (it comes with a later beat)")
        if short_name(env.cert) != env.key:
            raise Refused("bad_cert", f"{who}: the certificate it carries is not the one it names")
        try:
            cert = pki.load_cert(env.cert)
        except SecurityError as e:
            raise Refused("bad_cert", f"{who}: {e}") from None
        try:
            cert.verify_directly_issued_by(self.creds.ca_cert)
        except (ValueError, TypeError, InvalidSignature):
            raise Refused("other_ca", f"{who}: its certificate is not signed by this cluster's CA") from None
        try:
            node = pki.check_node_cert(cert, self.creds.ca_cert)
        except SecurityError as e:
            raise Refused("bad_cert", f"{who}: {e}") from None
        pub = cert.public_key()
        if not isinstance(pub, ec.EllipticCurvePublicKey):  # pragma: no cover - our CA signs only P-256 keys
            raise Refused("bad_cert", f"{who}: the certificate's key is not an ECDSA key")
        known = Known(node, pub, cert.not_valid_before_utc, cert.not_valid_after_utc)
        self._certs[env.key] = known
        while len(self._certs) > MAX_CERTS:
            self._certs.popitem(last=False)
        return known

    def _check_fresh(self, env: Sealed, term: int, who: str) -> None:
        """Refuse a datagram stamped outside the window, not after the sender's last one, or of a
        term below one it already sent; remember it otherwise."""
        now_us = time.time_ns() // 1000
        off = (env.stamp - now_us) / 1e6
        if abs(off) > self.window_s:
            when = f"{-off:.0f} s ago" if off < 0 else f"{off:.0f} s ahead"
            raise Refused("stale", f"{who}: stamped {when} (a replay, or its clock is off by that much)")
        last_stamp, last_term = self._seen.get(env.node, (0, 0))
        if env.stamp <= last_stamp:
            raise Refused("replay", f"{who}: a replayed datagram (stamp {env.stamp}, last {last_stamp})")
        if term < last_term:
            raise Refused("stale_term", f"{who}: term {term} after it already sent term {last_term}")
        self._seen[env.node] = (env.stamp, term)
        if len(self._seen) > MAX_CERTS:  # forget senders silent for longer than the window
            horizon = now_us - int(self.window_s * 1e6)
            self._seen = {n: v for n, v in self._seen.items() if v[0] >= horizon}

    def _refresh(self) -> None:
        """Re-read the revocation list now and then ('cluster revoke' may have written a newer one)."""
        now = time.monotonic()
        if now - self._refreshed < REFRESH_S:
            return
        self._refreshed = now
        try:
            if self.creds.refresh():
                log.info("revocation list: version %d", self.creds.revocation_version)
        except SecurityError as e:
            log.warning("cannot re-read the revocation list: %s", e)

    def revocation_version(self) -> int:
        self._refresh()  # 'cluster revoke' on this node wrote a newer list: say so in the next beat
        return self.creds.revocation_version

    def status(self) -> dict[str, Any]:
        sent = {k: {"datagrams": self.sent[k], "largest_bytes": self.largest[k]} for k in ("with_cert", "lean")}
        return {**super().status(), "certificates": len(self._certs), "sent": sent}


class Receiver(asyncio.DatagramProtocol):
    """Hands every datagram of a UDP endpoint to ``on_datagram(data, (host, port))``."""

    def __init__(self, on_datagram: Callable[[bytes, tuple[str, int]], None]) -> None:
        self.on_datagram = on_datagram

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        self.on_datagram(data, (str(addr[0]), int(addr[1])))

    def error_received(self, exc: Exception) -> None:
        log.debug("datagram error: %s", exc)


def for_credentials(creds: Credentials | None) -> Datagrams:
    """Signed election traffic with credentials, plaintext without."""
    return Plain() if creds is None else Signed(creds)


def short_name(cert_der: bytes) -> bytes:
    """What an envelope calls a certificate: the first 16 bytes of the SHA-256 of its DER."""
    return hashlib.sha256(cert_der).digest()[:KEY_BYTES]


def sealed(
    creds: Credentials,
    msg: Message,
    stamp: int,
    *,
    to: str | None = None,
    with_cert: bool = True,
    node: str | None = None,
) -> Sealed:
    """``msg`` signed by ``creds``' node key, for node ``to`` (None: any peer, a beat);
    ``node``: whom the envelope claims to come from (tests forge it)."""
    der = creds.node_cert_der
    key, body = short_name(der), encode(msg)
    claimed = node or creds.node_id
    cluster = str(getattr(msg, "cluster", creds.cluster_id))
    sig = creds.sign(seal_bytes(cluster, claimed, to, stamp, key, body))
    return Sealed(cluster, claimed, stamp, key, body, sig, der if with_cert else None, to)


def _decode(data: bytes, src: tuple[str, int]) -> Message:
    try:
        msg, _ = decode(data)
    except ProtocolError as e:
        raise Refused("malformed", f"a malformed datagram from {src[0]}: {e}") from None
    return msg
