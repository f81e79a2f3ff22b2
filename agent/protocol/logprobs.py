"""Log-probabilities of chosen tokens, as a last stage returns them beside the ids (never logits).

A step asks for them through its sampling settings (:attr:`~agent.protocol.data.SamplingSpec.logprobs`:
how many alternatives each token lists, 0 to :data:`MAX_TOP_LOGPROBS`). The last stage answers,
for every token it chose, the token's log-probability under the model's distribution (the
log-softmax of the logits it was chosen from, at temperature 1) and the most likely tokens with
theirs, most likely first (:class:`TokenLogprobs`).

On the wire they are the answer's payload (``Ids``, ``BatchIds``), a block per stream of ``k``
tokens with ``n`` alternatives each, little-endian::

    float32 [k] chosen | int32 [k, n] alternatives' ids | float32 [k, n] their log-probabilities

so an answer stays small and bounded (4 bytes a token, 8 more an alternative) whatever the
vocabulary, and the header stays within its bound however many streams a micro-batch holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agent.protocol.codec import ProtocolError

MAX_TOP_LOGPROBS = 20  # alternatives a token may list (OpenAI's bound for ``top_logprobs``)
LOGPROB_FLOOR = -9999.0  # what an impossible token's log-probability is sent as (OpenAI's figure)
MAX_TOKEN_ID = 1 << 24


@dataclass(frozen=True)
class TokenLogprobs:
    """One chosen token's log-probability and the ``top`` most likely tokens as (id, log-probability),
    most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def from_arrays(chosen: np.ndarray, ids: np.ndarray, values: np.ndarray) -> tuple[TokenLogprobs, ...]:
    """Rows of log-probabilities from arrays: ``chosen`` [k], ``ids`` and ``values`` [k, n]."""
    return tuple(
        TokenLogprobs(float(c), tuple(zip((int(i) for i in row_ids), (float(v) for v in row_values), strict=True)))
        for c, row_ids, row_values in zip(chosen, ids, values, strict=True)
    )


def block_size(tokens: int, top: int) -> int:
    """The bytes of one stream's block: ``tokens`` tokens of ``top`` alternatives each."""
    return 4 * tokens * (1 + 2 * top)


def top_of(rows: Sequence[TokenLogprobs]) -> int:
    """How many alternatives every row lists (rows that list unlike counts are a ValueError)."""
    counts = {len(r.top) for r in rows}
    if len(counts) > 1:
        raise ValueError(f"rows list unlike counts of alternatives: {sorted(counts)}")
    return counts.pop() if counts else 0


def pack(rows: Sequence[TokenLogprobs]) -> bytes:
    """One stream's block (see the module)."""
    n = top_of(rows)
    chosen = np.array([r.logprob for r in rows], dtype="<f4")
    ids = np.array([[i for i, _ in r.top] for r in rows], dtype="<i4").reshape(len(rows), n)
    values = np.array([[v for _, v in r.top] for r in rows], dtype="<f4").reshape(len(rows), n)
    return chosen.tobytes() + ids.tobytes() + values.tobytes()


def unpack(block: bytes | memoryview, tokens: int, top: int, stream: str | None = None) -> tuple[TokenLogprobs, ...]:
    """One stream's block of ``tokens`` rows of ``top`` alternatives; a block of another size, or
    whose values are no log-probabilities (finite, at most 0, alternatives most likely first), or
    whose ids are out of range, is a ``bad_logprobs`` :class:`ProtocolError`."""
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ProtocolError("bad_logprobs", f"{top} alternatives a token: at most {MAX_TOP_LOGPROBS}", stream)
    need = block_size(tokens, top)
    if len(block) != need:
        raise ProtocolError(
            "bad_logprobs",
            f"log-probabilities of {len(block)} bytes; {tokens} tokens of {top} alternatives need {need}",
            stream,
        )
    raw = bytes(block)
    chosen = np.frombuffer(raw, dtype="<f4", count=tokens)
    ids = np.frombuffer(raw, dtype="<i4", count=tokens * top, offset=4 * tokens).reshape(tokens, top)
    values = np.frombuffer(raw, dtype="<f4", count=tokens * top, offset=4 * tokens * (1 + top)).reshape(tokens, top)
    for v in (chosen, values):
        if v.size and not (np.all(np.isfinite(v)) and v.max() <= 0.0 and v.min() >= LOGPROB_FLOOR):
            raise ProtocolError("bad_logprobs", f"log-probabilities must lie in {LOGPROB_FLOOR}..0", stream)
    if ids.size and (ids.min() < 0 or ids.max() >= MAX_TOKEN_ID):
        raise ProtocolError("bad_logprobs", f"alternatives' ids must lie in 0..{MAX_TOKEN_ID - 1}", stream)
    if top > 1 and np.any(np.diff(values, axis=1) > 0):
        raise ProtocolError("bad_logprobs", "alternatives must come most likely first", stream)
    return from_arrays(chosen, ids, values)


def top_field(v: object, name: str = "logprobs") -> int:
    """A count of alternatives (0..MAX_TOP_LOGPROBS) from a header; anything else is ``bad_field``."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOP_LOGPROBS:
        raise ProtocolError("bad_field", f"{name} must be an integer in 0..{MAX_TOP_LOGPROBS}, got {v!r}")
    return v
