"""Hostile frames for fuzzing: valid frames of every type a stage takes, and mutations of them.

Seeded (``random.Random``), fast, and dependency-free, so ``lakeshard bench security`` can send
hundreds of thousands; the tests drive the same mutations from hypothesis. No ``assign`` frame is
ever produced (a valid one re-assigns a plaintext stage by design: see SECURITY.md), and
generated streams are named ``fuzz-...`` unless a victim stream id is given to aim at.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np

from agent.protocol import (
    Close,
    Error,
    Fwd,
    Head,
    HeadTop,
    Ids,
    Message,
    Passed,
    Ping,
    Pong,
    SamplingSpec,
    encode,
)

PREFIX = struct.Struct("<2sBI")
# stands for the live stream's id (random, like every coordinator's): live_fuzz swaps it in at send time
VICTIM_MARK = "victim-" + "x" * 16
VICTIMS = (VICTIM_MARK,)
TYPES = (
    "fwd",
    "ids",
    "passed",
    "close",
    "error",
    "head",
    "head_top",
    "batch",
    "batch_ids",
    "ping",
    "pong",
    "beat",
    "vote",
    "x",
)
# values a header field is replaced with: wrong types, edges, huge and deep things
ODD: list[Any] = [
    None,
    True,
    -1,
    0,
    1,
    2**31,
    2**63 - 1,
    -(2**63),
    1e308,
    float("nan"),
    float("inf"),
    "",
    "x" * 300,
    "\x00",
    "../../etc/passwd",
    b"\xff" * 8,
    [],
    [1] * 70,
    {"a": 1},
    [[[[[[]]]]]],
    "f16",
    "i32",
    "i64",
    "f32",
    "u8",
]


def valid_frames(rng: random.Random, term: int, hidden: int, stream: str | None = None) -> Iterator[bytes]:
    """Well-formed frames (each may still be refused: unknown streams, wrong stage ...)."""
    while True:
        s = stream or f"fuzz-{rng.randrange(1 << 20):x}"
        seq, n = rng.randrange(64), rng.randint(1, 4)
        k = rng.randrange(10)
        if k == 0:
            ids = np.asarray([rng.randrange(50000) for _ in range(n)], dtype=np.int32)
            yield encode(Fwd(term=term, stream=s, seq=seq, n=n, dtype="i32", start=rng.random() < 0.5), ids)
        elif k == 1:
            h = np.zeros((1, n, hidden), np.float16)
            yield encode(Fwd(term=term, stream=s, seq=seq, n=n, dtype="f16", start=rng.random() < 0.5), h)
        elif k == 2:
            sp = SamplingSpec(rng.random(), 0.9, rng.randrange(1000))
            f = Fwd(term=term, stream=s, seq=seq, n=1, dtype="i32", rollback=rng.randrange(3), sampling=sp, auto=2)
            yield encode(f, np.asarray([[1]], np.int32))
        elif k == 3:
            yield encode(Close(term=term, stream=s))
        elif k == 4:
            yield encode(Error(code="boom", message="fuzz", stream=s, seq=seq))
        elif k == 5:
            yield encode(Head(term=term, stream=s, seq=seq, n=1), np.zeros((1, 1, hidden), np.float32))
        elif k == 6:
            yield encode(HeadTop(term=term, stream=s, seq=seq, values=(1.0,), ids=(3,)))
        elif k == 7:
            yield encode(Ids(term=term, stream=s, seq=seq, tokens=(1, 2)))
        elif k == 8:
            yield encode(Passed(term=term, stream=s, seq=seq))
        else:
            msg: Message = Ping(sent=rng.random()) if rng.random() < 0.5 else Pong(sent=1.0)
            yield encode(msg)


def split(frame: bytes) -> tuple[dict[str, Any], bytes] | None:
    """A frame's header and payload; None when it has no readable header map (mutated already)."""
    try:
        _, _, hlen = PREFIX.unpack_from(frame)
        h = msgpack.unpackb(frame[PREFIX.size : PREFIX.size + hlen], strict_map_key=False)
    except Exception:
        return None
    return (h, frame[PREFIX.size + hlen :]) if isinstance(h, dict) else None


def join(header: Any, payload: bytes, version: int = 1) -> bytes:
    head: bytes = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(b"LS", version, len(head)) + head + payload


def mutate(rng: random.Random, frame: bytes) -> bytes:
    """One random mutation of a frame: of its header's fields, of its payload, or of its bytes."""
    parts = split(frame)
    k = rng.randrange(12) if parts is not None else rng.randrange(7, 12)
    if k < 5:  # a header field: changed, removed, or one added
        assert parts is not None
        h, payload = parts
        key = rng.choice([*h.keys(), "t", "n", "dtype", "stream", "term", "extra"])
        if k == 0:
            h.pop(key, None)
        elif k == 1 and key == "t":
            h["t"] = rng.choice(TYPES)
        else:
            h[key] = rng.choice(ODD) if rng.random() < 0.8 else rng.randrange(-(2**40), 2**40)
        return join(h, payload)
    if k == 5:  # the payload cut, doubled or replaced
        assert parts is not None
        h, payload = parts
        return join(h, rng.choice([payload[: rng.randrange(len(payload) + 1)], payload * 2, rng.randbytes(17)]))
    if k == 6:  # a declared size far beyond what came
        assert parts is not None
        h, payload = parts
        h["n"] = rng.choice([2**15, 2**31, 10**9])
        return join(h, payload)
    if k == 7:  # the prefix: magic, version, header length
        b = bytearray(frame)
        if len(b) >= PREFIX.size:
            b[rng.randrange(PREFIX.size)] = rng.randrange(256)
        return bytes(b)
    if k == 8 and frame:  # bytes flipped anywhere
        b = bytearray(frame)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if k == 9 and frame:  # truncated
        return frame[: rng.randrange(len(frame))]
    if k == 10:  # a header that is no map, or nested deep
        return join(rng.choice([[1, 2], "fwd", 7, None, [[[[[[[[[[]]]]]]]]]]]), b"")
    return rng.randbytes(rng.randrange(1, 64))  # noise


def hostile_frames(
    seed: int, term: int, hidden: int, victim: str | None = None, valid_share: float = 0.1
) -> Iterator[bytes]:
    """An endless seeded mix: mostly mutated frames, some valid ones; ``victim``: a live stream's
    id that a share of them name (they must all be refused: it is another connection's)."""
    rng = random.Random(seed)
    mine = valid_frames(rng, term, hidden)
    aimed = valid_frames(rng, term, hidden, victim) if victim else mine
    while True:
        base = next(aimed if rng.random() < 0.3 else mine)
        yield base if rng.random() < valid_share else mutate(rng, base)
