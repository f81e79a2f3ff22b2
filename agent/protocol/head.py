"""Head-part messages: the last stage asks stage 0 to compute its part of the vocabulary head.

While a lone stream's step is on the last stage, stage 0 has nothing to do. So the last stage
sends the step's final hidden states (:class:`Head`, on its link back to stage 0) as soon as its
layers are done, computes its own rows of the head meanwhile, and takes whichever part's best
logit is larger; stage 0 answers on the same connection with its rows' best (:class:`HeadTop`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from agent.protocol.codec import (
    Message,
    ProtocolError,
    int_field,
    register,
    str_field,
)

MAX_HEAD_POSITIONS = 64


@dataclass(frozen=True)
class _HeadStep(Message):
    """The step (``stream``, ``seq``) of term ``term`` that a head part belongs to."""

    term: int
    stream: str
    seq: int

    @staticmethod
    def step(h: dict[str, Any]) -> tuple[int, str, int]:
        term, stream = int_field(h.get("term"), "term"), str_field(h.get("stream"), "stream", 128)
        return term, stream, int_field(h.get("seq"), "seq")


@dataclass(frozen=True)
class Head(_HeadStep):
    """Last stage -> stage 0: final hidden states (payload: float32 [1, n, hidden]) of ``seq``."""

    TYPE: ClassVar[str] = "head"
    dtype: ClassVar[str] = "f32"  # the payload's: hidden states go as float32
    n: int

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Head:
        term, stream, seq = cls.step(h)
        try:
            return Head(term, stream, seq, n=int_field(h.get("n"), "n", 1, MAX_HEAD_POSITIONS))
        except ProtocolError as e:
            e.stream, e.seq = stream, seq
            raise


@dataclass(frozen=True)
class HeadTop(_HeadStep):
    """Stage 0 -> last stage: per position, the best logit among stage 0's rows and its id."""

    TYPE: ClassVar[str] = "head_top"
    values: tuple[float, ...]
    ids: tuple[int, ...]

    def header(self) -> dict[str, Any]:
        d = super().header()
        d["values"], d["ids"] = list(self.values), list(self.ids)
        return d

    @classmethod
    def parse(cls, h: dict[str, Any]) -> HeadTop:
        values, ids = h.get("values"), h.get("ids")
        ok = isinstance(values, list) and isinstance(ids, list) and 0 < len(values) == len(ids) <= MAX_HEAD_POSITIONS
        if not ok or not all(isinstance(v, float) and math.isfinite(v) for v in values):  # type: ignore[union-attr]
            raise ProtocolError("bad_field", f"values and ids must be 1..{MAX_HEAD_POSITIONS} floats and ids alike")
        return HeadTop(
            *cls.step(h),
            values=tuple(values),  # type: ignore[arg-type]
            ids=tuple(int_field(i, "ids", 0, 2**31) for i in ids),  # type: ignore[union-attr]
        )


register(Head, HeadTop)
