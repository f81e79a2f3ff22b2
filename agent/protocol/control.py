"""Control-plane messages between agents: beats, acknowledgements and votes (one per UDP datagram).

In a cluster with credentials each of them travels inside a :class:`Sealed` envelope, signed
with the sender's node key (see :mod:`agent.security.datagrams`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from agent.protocol.codec import (
    Message,
    ProtocolError,
    device_field,
    float_field,
    int_field,
    opt_str_field,
    register,
    str_field,
)

ROLES = ("follower", "candidate", "coordinator")
STATES = ("available", "limited", "paused")
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
KIND_RE = re.compile(r"^[A-Z][A-Z0-9_]{0,15}$")
MAX_SCORE = 1e7  # GFLOP/s; anything above is a forgery or a bug
MAX_MEM = 1 << 50  # 1 PiB
MAX_OFFERS = 8  # devices one beat offers
MAX_REVOCATION = 1 << 31  # revocation list versions (one per revoked node: far fewer)
MAX_SETTINGS = 1 << 31  # cluster settings versions


def id_field(v: Any, name: str) -> str:
    if not isinstance(v, str) or not ID_RE.match(v):
        raise ProtocolError("bad_field", f"{name} must be an id of 1-64 letters, digits, '.', '_' or '-'")
    return v


def opt_id_field(v: Any, name: str) -> str | None:
    return None if v is None else id_field(v, name)


def bool_field(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError("bad_field", f"{name} must be true or false")
    return v


def choice_field(v: Any, name: str, options: tuple[str, ...]) -> str:
    if v not in options:
        raise ProtocolError("bad_field", f"{name} must be one of {', '.join(options)}, got {v!r}")
    return str(v)


def kinds_field(v: Any, name: str) -> tuple[str, ...]:
    if not isinstance(v, list | tuple) or len(v) > 16 or not all(isinstance(k, str) and KIND_RE.match(k) for k in v):
        raise ProtocolError("bad_field", f"{name} must be a list of at most 16 device kinds")
    return tuple(v)


@dataclass(frozen=True)
class DeviceOffer:
    """One device a node offers the planner (a part of :class:`Beat`): its measured speed
    (GFLOP/s) and free memory; ``own_memory``: a discrete GPU's, not the system's RAM."""

    name: str  # the OpenVINO device: CPU, GPU, GPU.1
    score: float
    mem_free: int
    own_memory: bool = False

    def wire(self) -> list[Any]:
        return [self.name, self.score, self.mem_free, self.own_memory]

    @classmethod
    def parse(cls, v: Any, name: str = "offer") -> DeviceOffer:
        if not isinstance(v, list | tuple) or len(v) != 4:
            raise ProtocolError("bad_field", f"{name} must be [device, score, mem_free, own_memory]")
        return DeviceOffer(
            name=device_field(v[0], f"{name} device"),
            score=float_field(v[1], f"{name} score", 0.0, MAX_SCORE),
            mem_free=int_field(v[2], f"{name} mem_free", 0, MAX_MEM),
            own_memory=bool_field(v[3], f"{name} own_memory"),
        )


EXPORT_RE = re.compile(r"^[0-9a-f]{32}$")
MAX_HELD = 4  # exports one beat says its node holds whole
MAX_LAYERS = 4096


def export_field(v: Any, name: str) -> str:
    """An export's content id (see :func:`agent.export.held.content_id`): 32 lower-case hex digits."""
    if not isinstance(v, str) or not EXPORT_RE.match(v):
        raise ProtocolError("bad_field", f"{name} must be an export id of 32 lower-case hex digits")
    return v


@dataclass(frozen=True)
class StageReport:
    """The stage a node serves (a part of :class:`Beat`): what a newly elected coordinator adopts
    instead of planning and exporting again (see :mod:`coordinator.service.takeover`)."""

    model: str  # the model's name, as the export's manifest says
    export: str  # the export's content id
    stage: int
    stages: int
    start: int  # layers start..end-1
    end: int
    term: int  # the (data) term it was assigned in

    def wire(self) -> list[Any]:
        return [self.model, self.export, self.stage, self.stages, self.start, self.end, self.term]

    @classmethod
    def parse(cls, v: Any, name: str = "serving") -> StageReport:
        if not isinstance(v, list | tuple) or len(v) != 7:
            raise ProtocolError("bad_field", f"{name} must be [model, export, stage, stages, start, end, term]")
        stages = int_field(v[3], f"{name} stages", 1, MAX_LAYERS)
        end = int_field(v[5], f"{name} end", 1, MAX_LAYERS)
        return StageReport(
            model=str_field(v[0], f"{name} model", 128),
            export=export_field(v[1], f"{name} export"),
            stage=int_field(v[2], f"{name} stage", 0, stages - 1),
            stages=stages,
            start=int_field(v[4], f"{name} start", 0, end - 1),
            end=end,
            term=int_field(v[6], f"{name} term"),
        )


def held_field(v: Any, name: str) -> tuple[str, ...]:
    if not isinstance(v, list | tuple) or len(v) > MAX_HELD:
        raise ProtocolError("bad_field", f"{name} must be a list of at most {MAX_HELD} export ids")
    return tuple(export_field(x, name) for x in v)


def settings_field(v: Any, name: str) -> tuple[int, str] | None:
    """A cluster settings document's (version, set_by), or None."""
    if v is None:
        return None
    if not isinstance(v, list | tuple) or len(v) != 2:
        raise ProtocolError("bad_field", f"{name} must be [version, set_by]")
    return int_field(v[0], f"{name} version", 1, MAX_SETTINGS), id_field(v[1], f"{name} set_by")


def offers_field(v: Any, name: str) -> tuple[DeviceOffer, ...]:
    if not isinstance(v, list | tuple) or len(v) > MAX_OFFERS:
        raise ProtocolError("bad_field", f"{name} must be a list of at most {MAX_OFFERS} device offers")
    return tuple(DeviceOffer.parse(x, name) for x in v)


@dataclass(frozen=True)
class Beat(Message):
    """Every node to every peer, every beat interval: "I am alive, and this is what I offer".

    A coordinator's beat is also a command ("I coordinate term ``term``"): the receiver
    admits or refuses it and answers with an :class:`Ack`.
    """

    TYPE: ClassVar[str] = "beat"
    cluster: str
    node: str
    port: int
    term: int
    role: str
    leader: str | None
    state: str
    eligible: bool
    score: float
    mem_free: int
    mem_total: int
    devices: tuple[str, ...]
    version: str
    followers: int = 0
    # what node maps show (optional: older agents leave them out)
    name: str | None = None  # the machine's host name
    reason: str | None = None  # why it is limited or paused
    reason_kind: str | None = None  # the same for programs: a PauseReason value (older agents leave it out)
    temp_c: float | None = None
    tok_s: float = 0.0  # positions its stage computed per second, lately
    next_rtt_ms: float | None = None  # round trip from its stage to the next agent of the ring
    # each device it offers (older agents leave them out: score and mem_free above stand for the node)
    offers: tuple[DeviceOffer, ...] = ()
    # the version of the revocation list the sender holds (-1: none, or a plaintext node): members
    # that hold an older one fetch the sender's (see agent.cluster.revocation_gossip)
    revocation: int = -1
    # the stage it serves now (None: none), and the exports it holds whole (newest first): a new
    # coordinator keeps running stages where they are and moves a lost one to a node that holds it
    serving: StageReport | None = None
    exports: tuple[str, ...] = ()
    needed: int = 0  # a coordinator's: the first ``needed`` exports are the cluster's (running, fallback): copy them
    # the cluster settings document the sender holds, as (version, set_by) (None: none; older
    # agents leave it out): members that hold an older one fetch the sender's (agent.cluster.settings_gossip)
    settings: tuple[int, str] | None = None

    def header(self) -> dict[str, Any]:
        d = super().header()
        d["devices"] = list(self.devices)
        d["offers"] = [o.wire() for o in self.offers]
        d["serving"] = None if self.serving is None else self.serving.wire()
        d["exports"] = list(self.exports)
        d["settings"] = list(self.settings) if self.settings is not None else None
        return d

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Beat:
        mem_total = int_field(h.get("mem_total"), "mem_total", 0, MAX_MEM)
        return Beat(
            cluster=id_field(h.get("cluster"), "cluster"),
            node=id_field(h.get("node"), "node"),
            port=int_field(h.get("port"), "port", 1, 65535),
            term=int_field(h.get("term"), "term"),
            role=choice_field(h.get("role"), "role", ROLES),
            leader=opt_id_field(h.get("leader"), "leader"),
            state=choice_field(h.get("state"), "state", STATES),
            eligible=bool_field(h.get("eligible"), "eligible"),
            score=float_field(h.get("score"), "score", 0.0, MAX_SCORE),
            mem_free=int_field(h.get("mem_free"), "mem_free", 0, mem_total),
            mem_total=mem_total,
            devices=kinds_field(h.get("devices"), "devices"),
            version=str_field(h.get("version"), "version", 32),
            followers=int_field(h.get("followers", 0), "followers", 0, 1 << 16),
            name=opt_str_field(h.get("name"), "name", 128),
            reason=opt_str_field(h.get("reason"), "reason", 200),
            reason_kind=opt_str_field(h.get("reason_kind"), "reason_kind", 32),
            temp_c=None if h.get("temp_c") is None else float_field(h.get("temp_c"), "temp_c", -100.0, 300.0),
            tok_s=float_field(h.get("tok_s", 0.0), "tok_s", 0.0, 1e7),
            next_rtt_ms=None if h.get("next_rtt_ms") is None else float_field(h["next_rtt_ms"], "next_rtt_ms", 0, 1e6),
            offers=offers_field(h.get("offers", []), "offers"),
            revocation=int_field(h.get("revocation", -1), "revocation", -1, MAX_REVOCATION),
            serving=None if h.get("serving") is None else StageReport.parse(h["serving"]),
            exports=held_field(h.get("exports", []), "exports"),
            needed=int_field(h.get("needed", 0), "needed", 0, MAX_HELD),
            settings=settings_field(h.get("settings"), "settings"),
        )


@dataclass(frozen=True)
class Ack(Message):
    """The answer to a coordinator's beat: admitted, or refused with a reason (``code``)."""

    TYPE: ClassVar[str] = "ack"
    cluster: str
    node: str
    term: int  # the receiver's term after handling the beat
    leader: str | None  # the coordinator the receiver follows
    accepted: bool
    code: str | None = None
    message: str | None = None

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Ack:
        return Ack(
            cluster=id_field(h.get("cluster"), "cluster"),
            node=id_field(h.get("node"), "node"),
            term=int_field(h.get("term"), "term"),
            leader=opt_id_field(h.get("leader"), "leader"),
            accepted=bool_field(h.get("accepted"), "accepted"),
            code=opt_str_field(h.get("code"), "code", 64),
            message=opt_str_field(h.get("message"), "message", 500),
        )


@dataclass(frozen=True)
class VoteRequest(Message):
    TYPE: ClassVar[str] = "vote_request"
    cluster: str
    node: str  # the candidate
    port: int
    term: int
    eligible: bool
    score: float
    mem_free: int

    @classmethod
    def parse(cls, h: dict[str, Any]) -> VoteRequest:
        return VoteRequest(
            cluster=id_field(h.get("cluster"), "cluster"),
            node=id_field(h.get("node"), "node"),
            port=int_field(h.get("port"), "port", 1, 65535),
            term=int_field(h.get("term"), "term", 1),
            eligible=bool_field(h.get("eligible"), "eligible"),
            score=float_field(h.get("score"), "score", 0.0, MAX_SCORE),
            mem_free=int_field(h.get("mem_free"), "mem_free", 0, MAX_MEM),
        )


@dataclass(frozen=True)
class Vote(Message):
    TYPE: ClassVar[str] = "vote"
    cluster: str
    node: str  # the voter
    term: int  # the term voted in
    voter_term: int  # the voter's term after handling the request
    granted: bool
    code: str | None = None
    message: str | None = None

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Vote:
        return Vote(
            cluster=id_field(h.get("cluster"), "cluster"),
            node=id_field(h.get("node"), "node"),
            term=int_field(h.get("term"), "term", 1),
            voter_term=int_field(h.get("voter_term"), "voter_term"),
            granted=bool_field(h.get("granted"), "granted"),
            code=opt_str_field(h.get("code"), "code", 64),
            message=opt_str_field(h.get("message"), "message", 500),
        )


def bytes_field(v: Any, name: str, lo: int, hi: int) -> bytes:
    if not isinstance(v, bytes) or not (lo <= len(v) <= hi):
        raise ProtocolError("bad_field", f"{name} must be {lo}..{hi} bytes")
    return v


SEAL_DOMAIN = b"lakeshard/election/1\0"  # what a node key signs is never mistaken for anything else
KEY_BYTES = 16  # the certificate's short name: the first bytes of its DER's SHA-256
MAX_SIG = 80  # an ECDSA P-256 signature in DER is at most 72 bytes
MAX_CERT = 2048  # a node certificate's DER is about 480 bytes
MAX_BODY = 1200  # the inner message (a beat that offers 8 devices is about 550 bytes)


@dataclass(frozen=True)
class Sealed(Message):
    """A control message (``body``: a whole :class:`Beat`, :class:`Ack`, :class:`VoteRequest` or
    :class:`Vote` frame) signed by its sender, in a cluster with credentials.

    ``sig`` is the ECDSA P-256 (SHA-256, DER) signature of :meth:`signed_bytes` with the key of
    the certificate named by ``key``; ``cert`` (its DER) comes with some datagrams only, so a
    receiver learns it once and keeps it. ``stamp`` (microseconds since the Unix epoch, strictly
    increasing per sender) lets receivers refuse replays; ``to`` names the node a reply or a vote
    request is for (a beat goes to every peer alike, one envelope and one stamp for all), so a
    datagram recorded on its way to one node cannot be replayed to another.
    """

    TYPE: ClassVar[str] = "sealed"
    cluster: str
    node: str  # the sender, as its certificate must name it
    stamp: int
    key: bytes
    body: bytes
    sig: bytes
    cert: bytes | None = None
    to: str | None = None

    def signed_bytes(self) -> bytes:
        return seal_bytes(self.cluster, self.node, self.to, self.stamp, self.key, self.body)

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Sealed:
        return Sealed(
            cluster=id_field(h.get("cluster"), "cluster"),
            node=id_field(h.get("node"), "node"),
            stamp=int_field(h.get("stamp"), "stamp"),
            key=bytes_field(h.get("key"), "key", KEY_BYTES, KEY_BYTES),
            body=bytes_field(h.get("body"), "body", 1, MAX_BODY),
            sig=bytes_field(h.get("sig"), "sig", 8, MAX_SIG),
            cert=None if h.get("cert") is None else bytes_field(h.get("cert"), "cert", 64, MAX_CERT),
            to=opt_id_field(h.get("to"), "to"),
        )


def seal_bytes(cluster: str, node: str, to: str | None, stamp: int, key: bytes, body: bytes) -> bytes:
    """What a :class:`Sealed` envelope's signature covers (everything but the certificate, which
    proves itself: it must hash to ``key`` and chain to the cluster CA)."""
    return SEAL_DOMAIN + bytes(msgpack.packb([cluster, node, to, stamp, key, body], use_bin_type=True))


register(Beat, Ack, VoteRequest, Vote, Sealed)
