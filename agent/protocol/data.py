"""Data-plane messages: what travels along the ring (and the assignment that sets it up)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from agent.protocol.codec import (
    DTYPES,
    MAX_TOKENS_PER_FRAME,
    Message,
    ProtocolError,
    float_field,
    int_field,
    int_list_field,
    opt_device_field,
    opt_str_field,
    register,
    str_field,
)
from agent.protocol.logprobs import TokenLogprobs, pack, top_field, top_of, unpack


@dataclass(frozen=True)
class SamplingSpec:
    """How a stream's tokens are chosen, and what the last stage tells of each: ``logprobs`` asks
    for every token's log-probability and that many most likely alternatives' (0 to
    :data:`~agent.protocol.logprobs.MAX_TOP_LOGPROBS`; None: ids alone). On the wire a list,
    ``[temperature, top_p, seed]``, with ``logprobs`` fourth only when asked (so a stream that
    does not ask sends what it always sent)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    logprobs: int | None = None

    def to_list(self) -> list[float | int]:
        base: list[float | int] = [self.temperature, self.top_p, self.seed]
        return base if self.logprobs is None else [*base, self.logprobs]

    @staticmethod
    def from_list(v: Any) -> SamplingSpec:
        if not isinstance(v, list | tuple) or len(v) not in (3, 4):
            raise ProtocolError("bad_field", "sampling must be [temperature, top_p, seed] or [..., logprobs]")
        t = float_field(v[0], "temperature", 0.0, 100.0)
        p = float_field(v[1], "top_p", 1e-6, 1.0)
        lp = top_field(v[3], "logprobs") if len(v) == 4 else None
        return SamplingSpec(t, p, int_field(v[2], "seed", 0, 2**63 - 1), lp)


@dataclass(frozen=True)
class Fwd(Message):
    """Run ``n`` new positions of ``stream`` through the stage; the payload is ids or hidden states.

    ``start`` resets the stream (a new request); ``rollback`` first disables that many of the
    stream's last KV slots (rejected speculative tokens). ``logits`` lists which of the n
    positions the last stage turns into tokens (empty: the last one).

    ``auto`` lets the ring continue on its own (greedy or seeded sampling, no drafting): the
    last stage feeds its token straight back to stage 0 as the next step, up to ``auto`` more
    times or until it produces one of the ``stop`` ids, while it still reports every token to
    the coordinator. The coordinator leaves the per-token critical path; it ends such a stream
    early by closing it.

    ``ack`` asks stage 0 to tell the sender (:class:`Passed`) once it has computed the frame:
    a coordinator that shares stage 0's machine starts its draft's prefill of the prompt then,
    not beside stage 0's.
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
    auto: int = 0
    stop: tuple[int, ...] = ()
    busy_ms: float = 0.0  # the longest any stage so far computed this frame (the ring's bottleneck)
    ack: bool = False
    ring_streams: int = 0  # the most streams any stage so far holds (1: this stream has the ring to itself)

    def header(self) -> dict[str, Any]:
        d = super().header()
        d["logits"] = list(self.logits)
        d["stop"] = list(self.stop)
        d["sampling"] = self.sampling.to_list()
        return d

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Fwd:
        stream = str_field(h.get("stream"), "stream", 128)
        seq = int_field(h.get("seq"), "seq")
        try:
            dtype = h.get("dtype")
            if dtype not in DTYPES:
                raise ProtocolError("bad_dtype", f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
            n = int_field(h.get("n"), "n", 1, MAX_TOKENS_PER_FRAME)
            logits = int_list_field(h.get("logits", []), "logits")
            if any(i >= n for i in logits):
                raise ProtocolError("bad_field", f"logits positions must lie in 0..{n - 1}")
            start = h.get("start", False)
            ret_logits = h.get("ret_logits", False)
            ack = h.get("ack", False)
            if not all(isinstance(b, bool) for b in (start, ret_logits, ack)):
                raise ProtocolError("bad_field", "start, ret_logits and ack must be true or false")
            return Fwd(
                term=int_field(h.get("term"), "term"),
                stream=stream,
                seq=seq,
                n=n,
                dtype=dtype,
                start=start,
                rollback=int_field(h.get("rollback", 0), "rollback", 0, 1 << 20),
                logits=logits,
                sampling=SamplingSpec.from_list(h.get("sampling", [0.0, 1.0, 0])),
                sent_at=float_field(h.get("sent_at", 0.0), "sent_at", 0.0, 1e12),
                ret_logits=ret_logits,
                auto=int_field(h.get("auto", 0), "auto", 0, 1 << 20),
                stop=int_list_field(h.get("stop", []), "stop", 64),
                busy_ms=float_field(h.get("busy_ms", 0.0), "busy_ms", 0.0, 1e7),
                ack=ack,
                ring_streams=int_field(h.get("ring_streams", 0), "ring_streams", 0, 1 << 20),
            )
        except ProtocolError as e:
            e.stream, e.seq = stream, seq
            raise


@dataclass(frozen=True)
class Ids(Message):
    """The last stage's chosen tokens for a ``Fwd`` (one per requested position).

    With ``ret_logits`` on the Fwd, ``tokens`` is empty and the payload holds ``rows`` x
    ``vocab`` float32 logits instead (the naive design, kept for the WAN comparison).

    ``logprobs`` (when the Fwd's sampling asked for them): each token's log-probability and its
    most likely alternatives', one per token. They travel as the payload (see
    :mod:`agent.protocol.logprobs`); the header says how many alternatives each lists
    (``logprobs``), and has no such key when none were asked.
    """

    TYPE: ClassVar[str] = "ids"
    term: int
    stream: str
    seq: int
    tokens: tuple[int, ...]
    sent_at: float = 0.0
    rows: int = 0
    vocab: int = 0
    busy_ms: float = 0.0  # the longest any stage computed this step
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token, when asked (the payload)

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.tokens):
            raise ValueError(f"{len(self.logprobs)} log-probabilities for {len(self.tokens)} tokens")

    def header(self) -> dict[str, Any]:
        d = super().header()
        d["tokens"] = list(self.tokens)
        d.pop("logprobs")
        if self.logprobs is not None:
            d["logprobs"] = top_of(self.logprobs)
        return d

    def payload(self) -> bytes:
        return b"" if self.logprobs is None else pack(self.logprobs)

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Ids:
        return cls.parse_frame(h, memoryview(b""))

    @classmethod
    def parse_frame(cls, h: dict[str, Any], payload: memoryview) -> Ids:
        stream, seq = str_field(h.get("stream"), "stream", 128), int_field(h.get("seq"), "seq")
        tokens = int_list_field(h.get("tokens"), "tokens")
        rows = int_field(h.get("rows", 0), "rows", 0, MAX_TOKENS_PER_FRAME)
        logprobs = None
        if h.get("logprobs") is not None:
            if rows:
                why = "an ids frame carries logits or log-probabilities, not both"
                raise ProtocolError("bad_field", why, stream, seq)
            try:
                logprobs = unpack(payload, len(tokens), top_field(h["logprobs"]), stream)
            except ProtocolError as e:
                e.stream, e.seq = stream, seq
                raise
        return Ids(
            term=int_field(h.get("term"), "term"),
            stream=stream,
            seq=seq,
            tokens=tokens,
            sent_at=float_field(h.get("sent_at", 0.0), "sent_at", 0.0, 1e12),
            rows=rows,
            vocab=int_field(h.get("vocab", 0), "vocab", 0, 1 << 24),
            busy_ms=float_field(h.get("busy_ms", 0.0), "busy_ms", 0.0, 1e7),
            logprobs=logprobs,
        )


@dataclass(frozen=True)
class Passed(Message):
    """Stage 0 -> the frame's sender: it has computed the ``Fwd`` asked with ``ack``."""

    TYPE: ClassVar[str] = "passed"
    term: int
    stream: str
    seq: int

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Passed:
        return Passed(
            term=int_field(h.get("term"), "term"),
            stream=str_field(h.get("stream"), "stream", 128),
            seq=int_field(h.get("seq"), "seq"),
        )


@dataclass(frozen=True)
class Close(Message):
    """Forget a stream (its KV state is released); forwarded along the ring."""

    TYPE: ClassVar[str] = "close"
    term: int
    stream: str

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Close:
        return Close(term=int_field(h.get("term"), "term"), stream=str_field(h.get("stream"), "stream", 128))


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
        seq, stage, text = h.get("seq"), h.get("stage"), h.get("message", "")
        return Error(
            code=str_field(h.get("code"), "code", 64),
            message=text[:2000] if isinstance(text, str) else "",
            stream=opt_str_field(h.get("stream"), "stream", 128),
            seq=None if seq is None else int_field(seq, "seq"),
            stage=None if stage is None else int_field(stage, "stage", 0, 4096),
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
    loop_hop: str | None = None  # the last stage's link back to stage 0 (for Fwd.auto)
    device: str | None = None  # the OpenVINO device to compile on (the planner's choice); None: the agent's own

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Assign:
        wire = h.get("wire_dtype", "f16")
        if wire not in ("f16", "f32"):
            raise ProtocolError("bad_field", "wire_dtype must be f16 or f32")
        stages = int_field(h.get("stages"), "stages", 1, 4096)
        exact = h.get("exact", False)
        if not isinstance(exact, bool):
            raise ProtocolError("bad_field", "exact must be true or false")
        return Assign(
            term=int_field(h.get("term"), "term"),
            export_id=id_field(h.get("export_id"), "export_id"),
            stage=int_field(h.get("stage"), "stage", 0, stages - 1),
            stages=stages,
            manifest_sha256=hex_field(h.get("manifest_sha256"), "manifest_sha256"),
            artifacts_url=str_field(h.get("artifacts_url"), "artifacts_url", 2048),
            local_dir=opt_str_field(h.get("local_dir"), "local_dir"),
            next_hop=str_field(h.get("next_hop"), "next_hop", 2048),
            wire_dtype=wire,
            exact=exact,
            link_delay_ms=float_field(h.get("link_delay_ms", 0.0), "link_delay_ms", 0.0, 60000.0),
            link_mbps=float_field(h.get("link_mbps", 0.0), "link_mbps", 0.0, 1e6),
            loop_hop=opt_str_field(h.get("loop_hop"), "loop_hop"),
            device=opt_device_field(h.get("device"), "device"),
        )


@dataclass(frozen=True)
class Assigned(Message):
    TYPE: ClassVar[str] = "assigned"
    term: int
    stage: int
    device: str
    compile_s: float
    # a paged stage's KV pool and step budget (a stateful stage: None), which the coordinator's
    # micro-batching scheduler plans with; optional, so an older agent's answer still parses
    kv_blocks: int | None = None
    block_tokens: int | None = None
    step_tokens: int | None = None

    @property
    def paged(self) -> bool:
        return self.kv_blocks is not None and self.block_tokens is not None

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Assigned:
        def opt(name: str, hi: int) -> int | None:
            v = h.get(name)
            return None if v is None else int_field(v, name, 1, hi)

        return Assigned(
            term=int_field(h.get("term"), "term"),
            stage=int_field(h.get("stage"), "stage", 0, 4096),
            device=str_field(h.get("device"), "device", 64),
            compile_s=float_field(h.get("compile_s"), "compile_s", 0.0, 1e6),
            kv_blocks=opt("kv_blocks", 1 << 24),
            block_tokens=opt("block_tokens", 4096),
            step_tokens=opt("step_tokens", MAX_TOKENS_PER_FRAME),
        )


register(Fwd, Ids, Passed, Close, Error, Assign, Assigned)

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
EXPORT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def hex_field(v: Any, name: str) -> str:
    """A sha256 in lower-case hex (it names a folder on the receiver: nothing else may pass)."""
    if not isinstance(v, str) or not SHA256_RE.match(v):
        raise ProtocolError("bad_field", f"{name} must be 64 lower-case hex digits")
    return v


def id_field(v: Any, name: str) -> str:
    if not isinstance(v, str) or not EXPORT_ID_RE.match(v) or ".." in v:
        raise ProtocolError("bad_field", f"{name} must be 1-128 letters, digits, '.', '_' or '-'")
    return v


class Step(Protocol):
    """A frame whose payload is ``n`` positions of ``dtype`` for step ``seq`` of ``stream``."""

    @property
    def n(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def stream(self) -> str: ...
    @property
    def seq(self) -> int: ...


def tensor(fwd: Step, payload: memoryview, width: int) -> np.ndarray:
    """The payload (a Fwd's, a Head's) as an array of shape [1, n] (width 0: token ids) or [1, n, width]."""
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
