"""The frame codec, the field checks and the message registry (messages: ``data``, ``control``).

A frame is one binary websocket message::

    b"LS" | version (u8) | header length (u32 little-endian) | msgpack header | payload

The header is a msgpack map with ``"t"`` (the message type) and that type's fields; the
payload is raw tensor bytes (token ids or hidden states), described by the header. A message
whose payload is its own (a last stage's log-probabilities) writes it (:meth:`Message.payload`)
and reads it back (:meth:`Message.parse_frame`) itself. Every
field is checked on receipt: a frame that fails any check raises :class:`ProtocolError`,
which the receiver answers with an :class:`Error` frame and otherwise ignores. Peer control
messages (beats, votes) use the same frames, one per UDP datagram.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import msgpack
import numpy as np

MAGIC = b"LS"
VERSION = 1
_PREFIX = struct.Struct("<2sBI")
MAX_HEADER = 64 * 1024
MAX_TOKENS_PER_FRAME = 32768
MAX_HEADER_FIELDS = 64  # keys in one header map (and entries in any map inside it)
MAX_FRAME = 256 * 1024 * 1024  # websocket max_msg_size on every link
DEVICE_RE = re.compile(r"^[A-Z][A-Z0-9_]{0,15}(\.[0-9]{1,2})?$")  # an OpenVINO device: CPU, GPU, GPU.1

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


def int_field(v: Any, name: str, lo: int = 0, hi: int = 2**62) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not (lo <= v <= hi):
        raise ProtocolError("bad_field", f"{name} must be an integer in {lo}..{hi}, got {v!r}")
    return v


def float_field(v: Any, name: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not (lo <= float(v) <= hi):
        raise ProtocolError("bad_field", f"{name} must be a number in {lo}..{hi}, got {v!r}")
    return float(v)


def str_field(v: Any, name: str, max_len: int = 256) -> str:
    if not isinstance(v, str) or not (0 < len(v) <= max_len):
        raise ProtocolError("bad_field", f"{name} must be a non-empty string of at most {max_len} characters")
    return v


def opt_str_field(v: Any, name: str, max_len: int = 2048) -> str | None:
    return None if v is None else str_field(v, name, max_len)


def device_field(v: Any, name: str) -> str:
    if not isinstance(v, str) or not DEVICE_RE.match(v):
        raise ProtocolError("bad_field", f"{name} must be an OpenVINO device name such as CPU, GPU or GPU.1, got {v!r}")
    return v


def opt_device_field(v: Any, name: str) -> str | None:
    return None if v is None else device_field(v, name)


def int_list_field(v: Any, name: str, max_len: int = MAX_TOKENS_PER_FRAME) -> tuple[int, ...]:
    if not isinstance(v, list | tuple) or len(v) > max_len:
        raise ProtocolError("bad_field", f"{name} must be a list of at most {max_len} integers")
    return tuple(int_field(x, name, 0, 2**31) for x in v)


# ---- the message base and registry -------------------------------------------------------


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

    def payload(self) -> bytes:
        """The payload this message carries as its own (most carry none, or one the sender passes
        to :func:`encode`)."""
        return b""

    @classmethod
    def parse_frame(cls, h: dict[str, Any], payload: memoryview) -> Message:
        """The message of a frame's header and payload: what :meth:`parse` makes of the header,
        for a message whose payload is not its own."""
        return cls.parse(h)


REGISTRY: dict[str, type[Message]] = {}


def register(*kinds: type[Message]) -> None:
    for k in kinds:
        if k.TYPE in REGISTRY:
            raise ValueError(f"message type {k.TYPE!r} registered twice")
        REGISTRY[k.TYPE] = k


# ---- codec -----------------------------------------------------------------------------


def encode(msg: Message, payload: bytes | memoryview | np.ndarray = b"") -> bytes:
    """A frame of ``msg`` and ``payload`` (none given: the message's own, if it has one)."""
    own = msg.payload()
    if own:
        if len(payload):
            raise ValueError(f"a {msg.TYPE} message carries its own payload")
        payload = own
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
        h = msgpack.unpackb(
            bytes(frame[_PREFIX.size : _PREFIX.size + hlen]),
            raw=False,
            strict_map_key=True,
            max_array_len=MAX_TOKENS_PER_FRAME,
            max_map_len=MAX_HEADER_FIELDS,
        )
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError("bad_frame", f"header is not valid msgpack: {e}") from None
    if not isinstance(h, dict):
        raise ProtocolError("bad_frame", "header must be a map")
    t = h.get("t")
    kind = REGISTRY.get(t) if isinstance(t, str) else None
    if kind is None:
        raise ProtocolError("unknown_type", f"unknown message type {str(t)[:64]!r}")
    body = memoryview(frame)[_PREFIX.size + hlen :]
    try:
        msg = kind.parse_frame(h, body)
    except ProtocolError:
        raise
    except Exception as e:  # a parser that missed a check must not take the receiver down
        raise ProtocolError("bad_field", f"{kind.TYPE} header does not parse: {type(e).__name__}") from None
    return msg, body
