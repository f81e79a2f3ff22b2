"""Prefix caching on paged stages: a stream that starts on another stream's prompt head.

Real paged stages (SmolLM2 INT8 in 2 stages, exact compile properties, CPU: KV blocks of 32
tokens), each behind its :class:`PagedWorker`, in one process: a micro-batch frame goes into
stage 0, its output frame into stage 1, whose ``BatchIds`` are the tokens; exactly the frames
a coordinator and the ring exchange."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.protocol import Batch, BatchIds, Part, ProtocolError, decode
from agent.runtime.paged import PagedStage
from agent.serving.paged_worker import PagedWorker

SYSTEM = (
    "You are the help desk assistant of a small accounting office. Answer in two or three short sentences, "
    "politely, and say so when you do not know. The office opens at eight and closes at five; the printer, "
    "the scanner and the coffee machine are on the second floor, next to the meeting room."
)
QUESTIONS = ["How do I reset my password?", "Where is the printer on the second floor?"]
TOKENS = 12
BLOCKS = 64


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any) -> list[list[int]]:
    """Two chat prompts with the same system prompt: a common head of two whole blocks and more."""
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    ids = [list(map(int, smollm2_tokenizer.chat_ids(c))) for c in chats]
    common = next(i for i, (x, y) in enumerate(zip(*ids, strict=False)) if x != y)
    assert 64 <= common < 96 and [len(p) for p in ids] == [83, 85]
    return ids


class InProcessRing:
    """Paged stages chained by their frames: a micro-batch in, each part's tokens and errors out."""

    def __init__(self, stages: Sequence[PagedStage]) -> None:
        self.stages = list(stages)
        self.workers = [PagedWorker(s, max_streams=16) for s in stages]
        self.seq = 0

    def step(self, parts: list[tuple[Part, list[int]]]) -> tuple[dict[str, list[int]], dict[str, ProtocolError]]:
        self.seq += 1
        msg: Any = Batch(term=1, seq=self.seq, dtype="i32", parts=tuple(p for p, _ in parts))
        payload: Any = memoryview(np.asarray([t for _, ids in parts for t in ids], dtype=np.int32).tobytes())
        failed: dict[str, ProtocolError] = {}
        for w in self.workers:
            out = w.batch(msg, payload, range(len(msg.parts)), "f32")
            failed.update({str(e.stream): e for e in out.failed})
            if out.frame is None:
                return {}, failed
            msg, payload = decode(out.frame)
        assert isinstance(msg, BatchIds)
        return {s: list(t) for s, t in msg.tokens_of().items()}, failed

    def close(self, name: str) -> None:
        for w in self.workers:
            w.close(name)

    def free(self) -> list[int]:
        return [s.free_blocks for s in self.stages]

    def length(self, name: str) -> list[int]:
        return [w.stage.length(w.ids[name]) for w in self.workers]


@pytest.fixture(scope="module")
def ring(smollm2: Any) -> InProcessRing:
    from agent.export.exporter import ExportOptions, export_model

    export: Path = export_model(smollm2, [(0, 11), (11, 30)], ExportOptions(weights="int8"), quiet=True).dir
    stages = [PagedStage(export / f"stage_{i}", device="CPU", threads=1, exact=True, num_blocks=BLOCKS) for i in (0, 1)]
    assert [s.block_size for s in stages] == [32, 32]
    return InProcessRing(stages)


def _decode(ring: InProcessRing, toks: dict[str, list[int]], until: int) -> None:
    """Decode steps of every stream in ``toks``, one micro-batch a step, until each has ``until``."""
    while any(len(t) < until for t in toks.values()):
        got, failed = ring.step([(Part(s, ring.seq, 1, logits=1), [t[-1]]) for s, t in toks.items() if len(t) < until])
        assert not failed, failed
        for s, t in got.items():
            toks[s] += t


@pytest.fixture(scope="module")
def alone(ring: InProcessRing, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt computed whole by its own stream, then its greedy tokens."""
    out = []
    for i, p in enumerate(prompts):
        got, failed = ring.step([(Part(f"alone{i}", 0, len(p), start=True, logits=1), p)])
        assert not failed
        toks = {f"alone{i}": got[f"alone{i}"]}
        _decode(ring, toks, TOKENS)
        ring.close(f"alone{i}")
        out.append(toks[f"alone{i}"])
    assert ring.free() == [BLOCKS, BLOCKS]
    return out


def test_a_fork_of_a_prompt_head_gives_the_tokens_of_a_whole_prompt(
    ring: InProcessRing, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    """Stream b starts on stream a's first 64 positions (two KV blocks, shared, not computed),
    computes the rest of its prompt and decodes beside a; a closes first, b goes on. Both get
    the greedy tokens of their whole prompts computed alone, and every block comes back."""
    a, b = prompts
    got, failed = ring.step([(Part("a", 0, len(a), start=True, logits=1), a)])
    assert not failed
    toks = {"a": got["a"]}
    before = ring.free()
    got, failed = ring.step(
        [
            (Part("b", 0, len(b) - 64, start=True, logits=1, fork="a", fork_len=64), b[64:]),
            (Part("a", 1, 1, logits=1), toks["a"][-1:]),
        ]
    )
    assert not failed
    toks["a"] += got["a"]
    toks["b"] = got["b"]
    assert ring.length("b") == [len(b), len(b)]
    # b took the blocks of its 21 own positions only (one), its head is a's
    assert ring.free() == [f - 1 for f in before]
    _decode(ring, toks, TOKENS // 2)
    ring.close("a")  # the source leaves first: b keeps the shared blocks
    assert ring.free() == [BLOCKS - 3, BLOCKS - 3]  # b: 2 shared + 1 of its own (85 + 5 < 96 tokens)
    _decode(ring, {"b": toks["b"]}, TOKENS)
    assert toks["a"][: TOKENS // 2] == alone[0][: TOKENS // 2]
    assert toks["b"] == alone[1]
    ring.close("b")
    assert ring.free() == [BLOCKS, BLOCKS]


def test_bad_forks_fail_alone_and_the_other_parts_go_on(
    ring: InProcessRing, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    """Beside a's decode step and a good fork: forks of an unknown stream, of a stream that
    starts in the same micro-batch, of a head that is not whole blocks and of more positions
    than the source holds; then a rollback of a that would end inside the shared head. Each
    gets an error naming its own stream; a and the good fork get their tokens, and every block
    comes back."""
    a, b = prompts
    got, failed = ring.step([(Part("a", 0, len(a), start=True, logits=1), a), (Part("old", 0, 40, start=True), a[:40])])
    assert not failed
    toks = {"a": got["a"]}
    rest = b[64:]
    got, failed = ring.step(
        [
            (Part("a", 1, 1, logits=1), toks["a"][-1:]),
            (Part("ghost-fork", 0, 3, start=True, logits=1, fork="ghost", fork_len=32), rest[:3]),
            (Part("old", 1, 2, start=True), [1, 2]),  # starts over
            (Part("fork-of-old", 0, 3, start=True, logits=1, fork="old", fork_len=32), rest[:3]),
            (Part("ragged", 0, len(b) - 40, start=True, logits=1, fork="a", fork_len=40), b[40:]),
            (Part("too-long", 0, 3, start=True, logits=1, fork="a", fork_len=96), rest[:3]),
            (Part("b", 0, len(rest), start=True, logits=1, fork="a", fork_len=64), rest),
        ]
    )
    codes = {s: e.code for s, e in failed.items()}
    assert codes == {
        "ghost-fork": "unknown_stream",
        "fork-of-old": "bad_input",
        "ragged": "bad_input",
        "too-long": "bad_input",
    }, failed
    assert "'ghost'" in str(failed["ghost-fork"]) and "starts in this micro-batch" in str(failed["fork-of-old"])
    assert "blocks of 32 tokens" in str(failed["ragged"]) and "it holds 83" in str(failed["too-long"])
    assert set(got) == {"a", "b"}
    toks["a"] += got["a"]
    toks["b"] = got["b"]
    ring.close("old")
    # a's rollback to 40 of its 84 positions would leave it writing into the shared second block
    got, failed = ring.step(
        [(Part("a", 2, 1, rollback=len(a) + 1 - 40, logits=1), [5]), (Part("b", 2, 1, logits=1), toks["b"][-1:])]
    )
    assert set(got) == {"b"} and failed["a"].code == "bad_input"
    assert "inside a KV block another stream shares" in str(failed["a"])
    assert ring.length("a") == [len(a) + 1, len(a) + 1]  # the refused part changed nothing
    toks["b"] += got["b"]
    _decode(ring, toks, TOKENS)
    assert toks == {"a": alone[0], "b": alone[1]}
    for s in ("a", "b"):
        ring.close(s)
    assert ring.free() == [BLOCKS, BLOCKS]
