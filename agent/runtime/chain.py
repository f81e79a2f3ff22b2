"""Stages run as a chain in one process: the in-process runner behind ``lakeshard generate``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agent.runtime.sampling import Sampling, choose_token
from agent.runtime.stage import Stage, StageOutput, Stream


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)  # kept only when asked
    finish_reason: str = "length"
    prefill_s: float = 0.0
    decode_s: float = 0.0  # from the first token to the last
    step_s: list[float] = field(default_factory=list)  # each decode step after the first token

    @property
    def decode_tok_s(self) -> float:
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    @property
    def median_tok_s(self) -> float:
        """Decode speed from the median step time: robust to a preempted step on a busy machine."""
        return 1.0 / float(np.median(self.step_s)) if self.step_s else 0.0


class Chain:
    def __init__(self, stages: Sequence[Stage]) -> None:
        if not stages:
            raise ValueError("a chain needs at least one stage")
        if not stages[0].first or not stages[-1].last:
            raise ValueError("a chain must start with the first stage and end with the last")
        self.stages = list(stages)

    @classmethod
    def load(cls, export_dir: Path, *, device: str = "AUTO", threads: int | None = None, exact: bool = False) -> Chain:
        dirs = sorted(Path(export_dir).glob("stage_*"), key=lambda p: int(p.name.split("_")[1]))
        return cls([Stage(d, device=device, threads=threads, exact=exact) for d in dirs])

    def open_streams(self) -> list[Stream]:
        return [s.open_stream() for s in self.stages]

    def forward(self, streams: Sequence[Stream], ids: np.ndarray, logits_idx: np.ndarray | None = None) -> StageOutput:
        x: np.ndarray = ids
        out = StageOutput()
        for stage, st in zip(self.stages, streams, strict=True):
            out = stage.forward(st, x, logits_idx=logits_idx if stage.last else None, validate=stage.first)
            if out.hidden is not None:
                x = out.hidden
        return out

    def generate(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int = 128,
        sampling: Sampling | None = None,
        stop_ids: frozenset[int] = frozenset(),
        on_token: Callable[[int], None] | None = None,
        keep_logits: bool = False,
        streams: Sequence[Stream] | None = None,
    ) -> Generation:
        s = sampling or Sampling()
        streams = list(streams) if streams is not None else self.open_streams()
        for st in streams:
            st.reset()
        g = Generation()
        ids = np.asarray(prompt, dtype=np.int64)[None, :]
        t0 = time.perf_counter()
        t_first = t_prev = t0
        for step in range(max_tokens):
            out = self.forward(streams, ids)
            assert out.token_ids is not None and out.logits is not None
            pos = streams[-1].pos - 1  # logical position whose successor we choose
            tok = int(out.token_ids[-1]) if s.greedy else choose_token(out.logits[-1], s, pos)
            if keep_logits:
                g.logits.append(np.array(out.logits[-1], copy=True))
            now = time.perf_counter()
            if step == 0:
                t_first = now
                g.prefill_s = t_first - t0
            else:
                g.step_s.append(now - t_prev)
            t_prev = now
            if tok in stop_ids:
                g.finish_reason = "stop"
                break
            g.tokens.append(tok)
            if on_token is not None:
                on_token(tok)
            ids = np.array([[tok]], dtype=np.int64)
        g.decode_s = time.perf_counter() - t_first
        return g
