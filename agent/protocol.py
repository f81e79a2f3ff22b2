"""Every wire message, typed and frozen, in one place, with the frame codec.

A frame is one binary websocket message::

    b"LS" | version (u8) | header length (u32 little-endian) | msgpack header | payload

The header is a msgpack map with ``"t"`` (the message type) and that type's fields; the
payload is raw tensor bytes (token ids or hidden states), described by the header. Every
field is checked on receipt: a frame that fails any check raises :class:`ProtocolError`,
which the receiver answers with an :class:`Error` frame and otherwise ignores.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack
import numpy as np

MAGIC = b"LS"
VERSION = 1
_PREFIX = struct.Struct("<2sBI")
MAX_HEADER = 64 * 1024
MAX_TOKENS_PER_FRAME = 32768
MAX_FRAME = 256 * 1024 * 1024  # websocket max_msg_size on every link

DTYPES: dict[str, np.dtype[Any]] = {
    "i32": np.dtype("<i4"),
    "i64": np.dtype("<i8"),
    "f16": np.dtype("<f2"),
    "f32": np.dtype("<f4"),
}


class ProtocolError(ValueError):
    """A frame that cannot be accepted. ``code`` is a stable machine-readable reason."""

    def __init__(self, code: str, message: str, stream: str | None = None, seq: int | None = None) -> None:
        super().__init__(message)
        self.code, self.stream, self.seq = code, stream, seq


# ---- field checks -------------------------------------------------------------------------


def _int(v: Any, name: str, lo: int = 0, hi: int = 2**62) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not (lo <= v <= hi):
        raise ProtocolError("bad_field", f"{name} must be an integer in {lo}..{hi}, got {v!r}")
    return v


def _float(v: Any, name: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not (lo <= float(v) <= hi):
        raise ProtocolError("bad_field", f"{name} must be a number in {lo}..{hi}, got {v!r}")
    return float(v)


def _str(v: Any, name: str, max_len: int = 256) -> str:
    if not isinstance(v, str) or not (0 < len(v) <= max_len):
        raise ProtocolError("bad_field", f"{name} must be a non-empty string of at most {max_len} characters")
    return v


def _opt_str(v: Any, name: str, max_len: int = 2048) -> str | None:
    return None if v is None else _str(v, name, max_len)


def _int_list(v: Any, name: str, max_len: int = MAX_TOKENS_PER_FRAME) -> tuple[int, ...]:
    if not isinstance(v, list | tuple) or len(v) > max_len:
        raise ProtocolError("bad_field", f"{name} must be a list of at most {max_len} integers")
    return tuple(_int(x, name, 0, 2**31) for x in v)


# ---- messages -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[str] = ""

    def header(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["t"] = self.TYPE
        return d

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Message:
        raise NotImplementedError


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def to_list(self) -> list[float | int]:
        return [self.temperature, self.top_p, self.seed]

    @staticmethod
    def from_list(v: Any) -> SamplingSpec:
        if not isinstance(v, list | tuple) or len(v) != 3:
            raise ProtocolError("bad_field", "sampling must be [temperature, top_p, seed]")
        t = _float(v[0], "temperature", 0.0, 100.0)
        p = _float(v[1], "top_p", 1e-6, 1.0)
        return SamplingSpec(t, p, _int(v[2], "seed", 0, 2**63 - 1))


@dataclass(frozen=True)
class Fwd(Message):
    """Run ``n`` new positions of ``stream`` through the stage; the payload is ids or hidden states.

    ``start`` resets the stream (a new request); ``rollback`` first disables that many of the
    stream's last KV slots (rejected speculative tokens). ``logits`` lists which of the n
    positions the last stage turns into tokens (empty: the last one).
    """

    TYPE: ClassVar[str] = "fwd"
    term: int
    stream: str
    seq: int
    n: int
    dtype: str
    start: bool = False
    rollback: int = 0
    logits: tuple[int, ...] = ()
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    sent_at: float = 0.0
    ret_logits: bool = False  # the "naive" design: the last stage sends logits, not ids

    def header(self) -> dict[str, Any]:
        d = super().header()
        d["logits"] = list(self.logits)
        d["sampling"] = self.sampling.to_list()
        return d

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Fwd:
        stream = _str(h.get("stream"), "stream", 128)
        seq = _int(h.get("seq"), "seq")
        try:
            dtype = h.get("dtype")
            if dtype not in DTYPES:
                raise ProtocolError("bad_dtype", f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
            n = _int(h.get("n"), "n", 1, MAX_TOKENS_PER_FRAME)
            logits = _int_list(h.get("logits", []), "logits")
            if any(i >= n for i in logits):
                raise ProtocolError("bad_field", f"logits positions must lie in 0..{n - 1}")
            start = h.get("start", False)
            ret_logits = h.get("ret_logits", False)
            if not isinstance(start, bool) or not isinstance(ret_logits, bool):
                raise ProtocolError("bad_field", "start and ret_logits must be true or false")
            return Fwd(
                term=_int(h.get("term"), "term"),
                stream=stream,
                seq=seq,
                n=n,
                dtype=dtype,
                start=start,
                rollback=_int(h.get("rollback", 0), "rollback", 0, 1 << 20),
                logits=logits,
                sampling=SamplingSpec.from_list(h.get("sampling", [0.0, 1.0, 0])),
                sent_at=_float(h.get("sent_at", 0.0), "sent_at", 0.0, 1e12),
                ret_logits=ret_logits,
            )
        except ProtocolError as e:
            e.stream, e.seq = stream, seq
            raise


@dataclass(frozen=True)
class Ids(Message):
    """The last stage's chosen tokens for a ``Fwd`` (one per requested position).

    With ``ret_logits`` on the Fwd, ``tokens`` is empty and the payload holds ``rows`` x
    ``vocab`` float32 logits instead (the naive design, kept for the WAN comparison).
    """

    TYPE: ClassVar[str] = "ids"
    term: int
    stream: str
    seq: int
    tokens: tuple[int, ...]
    sent_at: float = 0.0
    rows: int = 0
    vocab: int = 0

    def header(self) -> dict[str, Any]:
        d = super().header()
        d["tokens"] = list(self.tokens)
        return d

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Ids:
        return Ids(
            term=_int(h.get("term"), "term"),
            stream=_str(h.get("stream"), "stream", 128),
            seq=_int(h.get("seq"), "seq"),
            tokens=_int_list(h.get("tokens"), "tokens"),
            sent_at=_float(h.get("sent_at", 0.0), "sent_at", 0.0, 1e12),
            rows=_int(h.get("rows", 0), "rows", 0, MAX_TOKENS_PER_FRAME),
            vocab=_int(h.get("vocab", 0), "vocab", 0, 1 << 24),
        )


@dataclass(frozen=True)
class Close(Message):
    """Forget a stream (its KV state is released); forwarded along the ring."""

    TYPE: ClassVar[str] = "close"
    term: int
    stream: str

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Close:
        return Close(term=_int(h.get("term"), "term"), stream=_str(h.get("stream"), "stream", 128))


@dataclass(frozen=True)
class Error(Message):
    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    stream: str | None = None
    seq: int | None = None
    stage: int | None = None

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Error:
        seq = h.get("seq")
        stage = h.get("stage")
        return Error(
            code=_str(h.get("code"), "code", 64),
            message=str(h.get("message", ""))[:2000],
            stream=_opt_str(h.get("stream"), "stream", 128),
            seq=None if seq is None else _int(seq, "seq"),
            stage=None if stage is None else _int(stage, "stage", 0, 4096),
        )


@dataclass(frozen=True)
class Assign(Message):
    """Coordinator -> agent: serve this stage of this export, send results to ``next_hop``."""

    TYPE: ClassVar[str] = "assign"
    term: int
    export_id: str
    stage: int
    stages: int
    manifest_sha256: str
    artifacts_url: str  # HTTP base the stage files can be fetched from
    local_dir: str | None  # where the files already are, if the agent shares the disk
    next_hop: str  # ws URL of the next stage, or of the coordinator's return endpoint
    wire_dtype: str = "f16"
    exact: bool = False
    link_delay_ms: float = 0.0
    link_mbps: float = 0.0  # 0: unlimited

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Assign:
        wire = h.get("wire_dtype", "f16")
        if wire not in ("f16", "f32"):
            raise ProtocolError("bad_field", "wire_dtype must be f16 or f32")
        stages = _int(h.get("stages"), "stages", 1, 4096)
        exact = h.get("exact", False)
        if not isinstance(exact, bool):
            raise ProtocolError("bad_field", "exact must be true or false")
        return Assign(
            term=_int(h.get("term"), "term"),
            export_id=_str(h.get("export_id"), "export_id"),
            stage=_int(h.get("stage"), "stage", 0, stages - 1),
            stages=stages,
            manifest_sha256=_str(h.get("manifest_sha256"), "manifest_sha256", 64),
            artifacts_url=_str(h.get("artifacts_url"), "artifacts_url", 2048),
            local_dir=_opt_str(h.get("local_dir"), "local_dir"),
            next_hop=_str(h.get("next_hop"), "next_hop", 2048),
            wire_dtype=wire,
            exact=exact,
            link_delay_ms=_float(h.get("link_delay_ms", 0.0), "link_delay_ms", 0.0, 60000.0),
            link_mbps=_float(h.get("link_mbps", 0.0), "link_mbps", 0.0, 1e6),
        )


@dataclass(frozen=True)
class Assigned(Message):
    TYPE: ClassVar[str] = "assigned"
    term: int
    stage: int
    device: str
    compile_s: float

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Assigned:
        return Assigned(
            term=_int(h.get("term"), "term"),
            stage=_int(h.get("stage"), "stage", 0, 4096),
            device=_str(h.get("device"), "device", 64),
            compile_s=_float(h.get("compile_s"), "compile_s", 0.0, 1e6),
        )


REGISTRY: dict[str, type[Message]] = {m.TYPE: m for m in (Fwd, Ids, Close, Error, Assign, Assigned)}


# ---- codec --------------------------------------------------------------------------------


def encode(msg: Message, payload: bytes | memoryview | np.ndarray = b"") -> bytes:
    if isinstance(payload, np.ndarray):
        payload = np.ascontiguousarray(payload).tobytes()
    head = msgpack.packb(msg.header(), use_bin_type=True)
    return bytes(_PREFIX.pack(MAGIC, VERSION, len(head)) + head + bytes(payload))


def decode(frame: bytes) -> tuple[Message, memoryview]:
    """Parse and validate a frame; returns the message and its payload (zero-copy view)."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise ProtocolError("bad_frame", "frames must be binary")
    if len(frame) < _PREFIX.size:
        raise ProtocolError("bad_frame", f"frame of {len(frame)} bytes is shorter than its prefix")
    magic, version, hlen = _PREFIX.unpack_from(frame)
    if magic != MAGIC:
        raise ProtocolError("bad_frame", "not a lakeshard frame (bad magic)")
    if version != VERSION:
        raise ProtocolError("bad_version", f"protocol version {version} is not supported (this is {VERSION})")
    if hlen > MAX_HEADER or _PREFIX.size + hlen > len(frame):
        raise ProtocolError("bad_frame", f"declared header of {hlen} bytes does not fit the frame")
    try:
        h = msgpack.unpackb(bytes(frame[_PREFIX.size : _PREFIX.size + hlen]), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError("bad_frame", f"header is not valid msgpack: {e}") from None
    if not isinstance(h, dict):
        raise ProtocolError("bad_frame", "header must be a map")
    kind = REGISTRY.get(h.get("t"))  # type: ignore[arg-type]
    if kind is None:
        raise ProtocolError("unknown_type", f"unknown message type {h.get('t')!r}")
    msg = kind.parse(h)
    return msg, memoryview(frame)[_PREFIX.size + hlen :]


def tensor(fwd: Fwd, payload: memoryview, width: int) -> np.ndarray:
    """The Fwd payload as an array of shape [1, n] (width 0: token ids) or [1, n, width]."""
    dt = DTYPES[fwd.dtype]
    shape = (1, fwd.n) if width == 0 else (1, fwd.n, width)
    need = int(np.prod(shape)) * dt.itemsize
    if len(payload) != need:
        raise ProtocolError(
            "bad_payload",
            f"payload has {len(payload)} bytes; {fwd.n} positions of {fwd.dtype}"
            f"{'' if width == 0 else f' x {width}'} need {need}",
            fwd.stream,
            fwd.seq,
        )
    return np.frombuffer(payload, dtype=dt).reshape(shape)
