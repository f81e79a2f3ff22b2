"""Paged stages run as a chain in one process, and a plain greedy loop over many streams.

The in-process counterpart of :class:`~agent.runtime.chain.Chain` for paged stages: one step
carries every active stream's new tokens through all stages, each stage in one infer call.
:func:`greedy` is the simplest scheduler that uses it (each step: every joined stream's next
prefill chunk or decode token); the coordinator's scheduler and the wire frames build on the
same :class:`~agent.runtime.paged.Entry` / :class:`~agent.runtime.paged.StepResult` shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agent.runtime.paged import Entry, PagedStage, StepResult


class PagedChain:
    def __init__(self, stages: Sequence[PagedStage]) -> None:
        if not stages or not stages[0].first or not stages[-1].last:
            raise ValueError("a chain must start with the first stage and end with the last")
        self.stages = list(stages)

    @classmethod
    def load(cls, export_dir: Path, **kw: Any) -> PagedChain:
        dirs = sorted(Path(export_dir).glob("stage_*"), key=lambda p: int(p.name.split("_")[1]))
        return cls([PagedStage(d, **kw) for d in dirs])

    @property
    def free_blocks(self) -> int:
        return min(s.free_blocks for s in self.stages)

    def open_stream(self, stream: int) -> None:
        for s in self.stages:
            s.open_stream(stream)

    def close_stream(self, stream: int) -> None:
        for s in self.stages:
            s.close_stream(stream)

    def rollback(self, stream: int, r: int) -> None:
        for s in self.stages:
            s.rollback(stream, r)

    def step(self, entries: Sequence[Entry]) -> StepResult:
        """Token ids in, the last stage's outputs back; hidden rows pass between the stages."""
        res = self.stages[0].step(entries)
        for stage in self.stages[1:]:
            passed = []
            for e in entries:
                hidden = res.out(e.stream).hidden
                assert hidden is not None
                passed.append(Entry(e.stream, hidden, e.logits))
            res = stage.step(passed)
        return res


@dataclass
class Request:
    """A stream for :func:`greedy`: its prompt, how many tokens to make, and the step it joins at."""

    prompt: Sequence[int]
    max_tokens: int
    join: int = 0
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)  # kept only when asked
    fed: int = 0  # prompt tokens already run


def greedy(
    chain: PagedChain, requests: dict[int, Request], *, chunk: int = 16, keep_logits: bool = False
) -> dict[int, Request]:
    """Run every request to its ``max_tokens`` greedy tokens, all joined streams in each step.

    A prompt goes in ``chunk``-token pieces (only its last piece asks for a token), so a long
    prompt never stalls the decoding streams; a stream closes (its blocks freed) when done.
    """
    if any(not r.prompt for r in requests.values()):
        raise ValueError("every request needs a prompt of at least one token")
    step = 0
    while any(len(r.tokens) < r.max_tokens for r in requests.values()):
        entries: list[Entry] = []
        for sid, r in requests.items():
            if step < r.join or len(r.tokens) >= r.max_tokens:
                continue
            if r.fed == 0 and not r.tokens:
                chain.open_stream(sid)
            if r.fed < len(r.prompt):
                piece = r.prompt[r.fed : r.fed + chunk]
                r.fed += len(piece)
                entries.append(Entry(sid, np.asarray(piece, dtype=np.int64), int(r.fed == len(r.prompt))))
            else:
                entries.append(Entry(sid, np.array([r.tokens[-1]], dtype=np.int64), 1))
        step += 1
        if not entries:
            continue
        res = chain.step(entries)
        for e in entries:
            if not e.logits:
                continue
            out, r = res.out(e.stream), requests[e.stream]
            assert out.token_ids is not None and out.logits is not None
            r.tokens.append(int(out.token_ids[-1]))
            if keep_logits:
                r.logits.append(np.array(out.logits[-1], copy=True))
            if len(r.tokens) >= r.max_tokens:
                chain.close_stream(e.stream)
    return requests
