"""Micro-batch messages: many streams' steps in one frame, for paged stages (issue 39).

A :class:`Batch` carries one micro-batch along the ring: several streams' new positions, decode
tokens and prefill chunks together, computed by each stage in one infer call. Its payload is
the parts' rows one after another (token ids into stage 0, hidden states between stages), in
the order of :attr:`Batch.parts`. Each part says what :class:`~agent.protocol.data.Fwd` says for
one stream: ``start`` (a new request), ``rollback`` (drop that many of its last positions
first: rejected speculative tokens), and ``logits`` (how many of its last positions the last
stage turns into tokens: 0 for a prefill chunk that is not the prompt's end, 1 for a decode
step, K+1 for a speculative verify). The last stage answers the coordinator with one
:class:`BatchIds`, the tokens of every part that asked for some (and their log-probabilities,
for the parts whose sampling asks for them).

Prefix caching: a starting part may name ``fork``, a stream of the same stages whose first
``fork_len`` positions (a prompt head both share) it takes over as they are, without computing
them; its rows then continue at position ``fork_len``. ``fork_len`` must be a multiple of every
stage's KV block size (``Assigned.block_tokens``), as only whole blocks are shared. The
``fork`` and ``fork_len`` columns are written only when some part forks, so frames without
forks are byte for byte what they were.

The header is columnar (one list per field, a list entry per part): header maps are bounded
to 64 keys, lists are not (up to the frame's token cap). Stages own their KV blocks, so no
frame carries block indices. A part a stage refuses (another connection's stream, an unknown
one) is answered with an :class:`~agent.protocol.data.Error` naming its stream; the other parts
go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from agent.protocol.codec import (
    DTYPES,
    MAX_TOKENS_PER_FRAME,
    Message,
    ProtocolError,
    float_field,
    int_field,
    register,
    str_field,
)
from agent.protocol.data import SamplingSpec
from agent.protocol.logprobs import TokenLogprobs, block_size, pack, top_field, top_of, unpack

MAX_PARTS = 256  # streams in one micro-batch (a stage's streams are bounded by the same number)
MAX_FORK_LEN = 1 << 20  # positions a fork may share (a stage checks them against its source's length)


@dataclass(frozen=True)
class Part:
    """One stream's share of a micro-batch."""

    stream: str
    seq: int  # the stream's step counter (its Fwd seq)
    n: int  # its rows in the payload (new positions)
    start: bool = False
    rollback: int = 0
    logits: int = 0  # of its last positions, how many become tokens (0: none, a prefill chunk)
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    fork: str | None = None  # (with start) the stream whose first fork_len positions it shares
    fork_len: int = 0  # positions shared: a multiple of the stages' block size; 0 without fork


def _column(h: dict[str, Any], name: str, count: int, default: Any = None) -> list[Any]:
    v = h.get(name)
    if v is None and default is not None:
        return [default] * count
    if not isinstance(v, list | tuple) or len(v) != count:
        raise ProtocolError("bad_batch", f"{name} must list one entry per part ({count})")
    return list(v)


def _bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError("bad_batch", f"{name} must be true or false")
    return v


@dataclass(frozen=True)
class Batch(Message):
    """A micro-batch of ``parts`` for one stage step; the payload is their rows, in order."""

    TYPE: ClassVar[str] = "batch"
    term: int
    seq: int  # the micro-batch's number (the coordinator's), echoed by BatchIds
    dtype: str
    parts: tuple[Part, ...]
    sent_at: float = 0.0
    busy_ms: float = 0.0  # the longest any stage so far computed this micro-batch

    @property
    def rows(self) -> int:
        return sum(p.n for p in self.parts)

    def spans(self) -> list[tuple[int, int]]:
        """Each part's [begin, end) rows in the payload."""
        out, at = [], 0
        for p in self.parts:
            out.append((at, at + p.n))
            at += p.n
        return out

    def header(self) -> dict[str, Any]:
        ps = self.parts
        return {
            "t": self.TYPE,
            "term": self.term,
            "seq": self.seq,
            "dtype": self.dtype,
            "sent_at": self.sent_at,
            "busy_ms": self.busy_ms,
            "streams": [p.stream for p in ps],
            "seqs": [p.seq for p in ps],
            "n": [p.n for p in ps],
            "start": [p.start for p in ps],
            "rollback": [p.rollback for p in ps],
            "logits": [p.logits for p in ps],
            "sampling": [p.sampling.to_list() for p in ps],
            **self._fork_columns(),
        }

    def _fork_columns(self) -> dict[str, list[Any]]:
        if all(p.fork is None for p in self.parts):
            return {}
        return {"fork": [p.fork for p in self.parts], "fork_len": [p.fork_len for p in self.parts]}

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Batch:
        dtype = h.get("dtype")
        if dtype not in DTYPES:
            raise ProtocolError("bad_dtype", f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        streams = h.get("streams")
        if not isinstance(streams, list | tuple) or not 1 <= len(streams) <= MAX_PARTS:
            raise ProtocolError("bad_batch", f"streams must list 1 to {MAX_PARTS} stream ids")
        count = len(streams)
        seqs = _column(h, "seqs", count)
        ns = _column(h, "n", count)
        starts = _column(h, "start", count, False)
        rollbacks = _column(h, "rollback", count, 0)
        logits = _column(h, "logits", count, 0)
        sampling = _column(h, "sampling", count, [0.0, 1.0, 0])
        forks = _column(h, "fork", count, None) if h.get("fork") is not None else [None] * count
        fork_lens = _column(h, "fork_len", count, 0)
        parts, seen, total = [], set(), 0
        for i in range(count):
            stream = str_field(streams[i], "stream", 128)
            if stream in seen:
                raise ProtocolError("bad_batch", f"stream {stream!r} appears twice in one micro-batch", stream)
            seen.add(stream)
            n = int_field(ns[i], "n", 1, MAX_TOKENS_PER_FRAME)
            k = int_field(logits[i], "logits", 0, n)
            total += n
            part = Part(
                stream=stream,
                seq=int_field(seqs[i], "seq"),
                n=n,
                start=_bool(starts[i], "start"),
                rollback=int_field(rollbacks[i], "rollback", 0, 1 << 20),
                logits=k,
                sampling=SamplingSpec.from_list(sampling[i]),
                fork=None if forks[i] is None else str_field(forks[i], "fork", 128),
                fork_len=int_field(fork_lens[i], "fork_len", 0, MAX_FORK_LEN),
            )
            _check_fork(part)
            parts.append(part)
        if total > MAX_TOKENS_PER_FRAME:
            raise ProtocolError("bad_batch", f"{total} rows in one micro-batch; at most {MAX_TOKENS_PER_FRAME}")
        return Batch(
            term=int_field(h.get("term"), "term"),
            seq=int_field(h.get("seq"), "seq"),
            dtype=dtype,
            parts=tuple(parts),
            sent_at=float_field(h.get("sent_at", 0.0), "sent_at", 0.0, 1e12),
            busy_ms=float_field(h.get("busy_ms", 0.0), "busy_ms", 0.0, 1e7),
        )


def _check_fork(p: Part) -> None:
    """A fork names another stream and shares some of its positions, and only a start forks."""
    if (p.fork is None) != (p.fork_len == 0):
        raise ProtocolError("bad_batch", f"part {p.stream!r}: fork and fork_len come together (fork_len 0 iff no fork)")
    if p.fork is None:
        return
    if p.fork == p.stream:
        raise ProtocolError("bad_batch", f"stream {p.stream!r} cannot fork itself", p.stream)
    if not p.start or p.rollback:
        raise ProtocolError("bad_batch", f"part {p.stream!r}: only a starting part (no rollback) forks", p.stream)


def batch_rows(msg: Batch, payload: memoryview, width: int) -> np.ndarray:
    """The payload as [rows] token ids (``width`` 0) or [rows, width] hidden states; a payload
    whose size does not match the parts' rows is a ``bad_payload`` error."""
    dt = DTYPES[msg.dtype]
    rows = msg.rows
    shape = (rows,) if width == 0 else (rows, width)
    need = rows * max(1, width) * dt.itemsize
    if len(payload) != need:
        raise ProtocolError(
            "bad_payload",
            f"payload has {len(payload)} bytes; {rows} rows of {msg.dtype}{f' x {width}' if width else ''} need {need}",
        )
    return np.frombuffer(payload, dtype=dt).reshape(shape)


@dataclass(frozen=True)
class BatchIds(Message):
    """The last stage's answer to a :class:`Batch`: each part's chosen tokens (as many as its
    ``logits``), for the parts that asked for some, in the batch's order.

    ``logprobs`` (when some part's sampling asked for them): per stream, its tokens'
    log-probabilities (None for a stream that did not ask). They travel as the payload, a block
    per stream that asked, in the streams' order (see :mod:`agent.protocol.logprobs`); the
    header lists how many alternatives each stream's tokens list (``logprobs``: null for a
    stream without), and has no such key when no stream asked."""

    TYPE: ClassVar[str] = "batch_ids"
    term: int
    seq: int
    streams: tuple[str, ...]
    counts: tuple[int, ...]  # tokens per stream
    tokens: tuple[int, ...]  # all of them, stream after stream
    sent_at: float = 0.0
    busy_ms: float = 0.0
    logprobs: tuple[tuple[TokenLogprobs, ...] | None, ...] | None = None  # per stream, when some asked

    def __post_init__(self) -> None:
        if self.logprobs is None:
            return
        if len(self.logprobs) != len(self.streams):
            raise ValueError(f"log-probabilities for {len(self.logprobs)} of {len(self.streams)} streams")
        for rows, c in zip(self.logprobs, self.counts, strict=True):
            if rows is not None and len(rows) != c:
                raise ValueError(f"{len(rows)} log-probabilities for {c} tokens")

    def tokens_of(self) -> dict[str, tuple[int, ...]]:
        out, at = {}, 0
        for s, c in zip(self.streams, self.counts, strict=True):
            out[s] = self.tokens[at : at + c]
            at += c
        return out

    def logprobs_of(self) -> dict[str, tuple[TokenLogprobs, ...]]:
        """Each stream's tokens' log-probabilities, for the streams that asked."""
        if self.logprobs is None:
            return {}
        return {s: rows for s, rows in zip(self.streams, self.logprobs, strict=True) if rows is not None}

    def header(self) -> dict[str, Any]:
        h = {
            "t": self.TYPE,
            "term": self.term,
            "seq": self.seq,
            "streams": list(self.streams),
            "counts": list(self.counts),
            "tokens": list(self.tokens),
            "sent_at": self.sent_at,
            "busy_ms": self.busy_ms,
        }
        if self.logprobs is not None:
            h["logprobs"] = [None if rows is None else top_of(rows) for rows in self.logprobs]
        return h

    def payload(self) -> bytes:
        if self.logprobs is None:
            return b""
        return b"".join(pack(rows) for rows in self.logprobs if rows is not None)

    @classmethod
    def parse(cls, h: dict[str, Any]) -> BatchIds:
        return cls.parse_frame(h, memoryview(b""))

    @classmethod
    def parse_frame(cls, h: dict[str, Any], payload: memoryview) -> BatchIds:
        streams = h.get("streams")
        if not isinstance(streams, list | tuple) or len(streams) > MAX_PARTS:
            raise ProtocolError("bad_batch", f"streams must list at most {MAX_PARTS} stream ids")
        names = tuple(str_field(s, "stream", 128) for s in streams)
        counts = tuple(int_field(c, "count", 0, MAX_TOKENS_PER_FRAME) for c in _column(h, "counts", len(names)))
        tokens = h.get("tokens")
        if not isinstance(tokens, list | tuple) or len(tokens) != sum(counts):
            raise ProtocolError("bad_batch", f"tokens must hold the {sum(counts)} tokens the counts add up to")
        return BatchIds(
            term=int_field(h.get("term"), "term"),
            seq=int_field(h.get("seq"), "seq"),
            streams=names,
            counts=counts,
            tokens=tuple(int_field(t, "token", 0, 1 << 24) for t in tokens),
            sent_at=float_field(h.get("sent_at", 0.0), "sent_at", 0.0, 1e12),
            busy_ms=float_field(h.get("busy_ms", 0.0), "busy_ms", 0.0, 1e7),
            logprobs=_read_logprobs(h, names, counts, payload),
        )


def _read_logprobs(
    h: dict[str, Any], streams: tuple[str, ...], counts: tuple[int, ...], payload: memoryview
) -> tuple[tuple[TokenLogprobs, ...] | None, ...] | None:
    """A BatchIds' log-probabilities: the ``logprobs`` column (alternatives per stream, or null)
    and the payload's blocks; None when the header has no such column."""
    if h.get("logprobs") is None:
        return None
    tops = [None if t is None else top_field(t) for t in _column(h, "logprobs", len(streams))]
    out: list[tuple[TokenLogprobs, ...] | None] = []
    at = 0
    for s, c, top in zip(streams, counts, tops, strict=True):
        if top is None:
            out.append(None)
            continue
        size = block_size(c, top)
        if at + size > len(payload):
            raise ProtocolError("bad_logprobs", f"the payload ends before stream {s!r}'s log-probabilities", s)
        out.append(unpack(payload[at : at + size], c, top, s))
        at += size
    if at != len(payload):
        raise ProtocolError("bad_logprobs", f"{len(payload) - at} bytes after the streams' log-probabilities")
    return tuple(out)


register(Batch, BatchIds)
