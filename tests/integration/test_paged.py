"""Paged stages on real OpenVINO (SmolLM2, INT8, CPU): the same tokens as the stateful path,
alone or batched, after rollback, and a block pool that never leaks or overflows silently."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import pytest
from openvino import opset13 as ops

from agent.runtime.blocks import PoolExhausted
from agent.runtime.chain import Chain
from agent.runtime.paged import Entry, PagedStage, PagedUnavailable
from agent.runtime.paged_chain import PagedChain, Request, greedy
from agent.runtime.stage import StageError
from tests.support.figures import report

TEXTS = [
    "What is the capital of France? Tell me about the city.",
    "Hi",
    "Write a short Python function that checks whether a number is prime.",
    "Why is the sky blue?",
    "Explain photosynthesis to a ten year old in simple words, please, with an example from a garden.",
    "List three tips for staying focused while working from home.",
    "Translate 'good morning' into Spanish and French.",
    "Give me a haiku about autumn leaves falling in the park at dusk.",
]
TOKENS = 24
SPLITS = {1: [(0, 30)], 2: [(0, 11), (11, 30)]}


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any) -> list[list[int]]:
    ids = [smollm2_tokenizer.chat_ids([{"role": "user", "content": t}]) for t in TEXTS]
    assert len({len(p) for p in ids}) > 4  # different prompt lengths
    return [list(map(int, p)) for p in ids]


@pytest.fixture(scope="module")
def exports(smollm2: Any) -> dict[int, Path]:
    from agent.export.exporter import ExportOptions, export_model

    return {n: export_model(smollm2, r, ExportOptions(weights="int8"), quiet=True).dir for n, r in SPLITS.items()}


@pytest.fixture(scope="module")
def paged(exports: dict[int, Path]) -> dict[int, PagedChain]:
    """Paged chains in the default precision (f32 activations and KV cache), one thread."""
    return {n: PagedChain.load(d, device="CPU", threads=1, num_blocks=128) for n, d in exports.items()}


def _greedy_one(chain: PagedChain, prompt: list[int], n: int) -> Request:
    return greedy(chain, {0: Request(prompt, n)}, keep_logits=True)[0]


@pytest.mark.parametrize("stages", [1, 2])
def test_one_stream_gives_the_stateful_chains_tokens(
    stages: int, exports: dict[int, Path], prompts: list[list[int]]
) -> None:
    """In exact precision (f32, no dynamic quantization): in the default one, a CPU with VNNI or
    AMX quantizes the two paths' activations differently (logits about 1 apart, measured)."""
    stateful = Chain.load(exports[stages], device="CPU", threads=1, exact=True)
    chain = PagedChain.load(exports[stages], device="CPU", threads=1, num_blocks=128, exact=True)
    for prompt in prompts[:2]:
        want = stateful.generate(prompt, max_tokens=32, keep_logits=True)
        got = _greedy_one(chain, prompt, 32)
        assert got.tokens == want.tokens
        diff = max(float(np.abs(a - b).max()) for a, b in zip(got.logits, want.logits, strict=True))
        assert diff < 1e-3
        report(f"paged vs stateful, {stages} stage(s), exact, 32 tokens: max |logit diff| {diff:.2e}")
    assert chain.free_blocks == 128


@pytest.mark.parametrize("stages", [1, 2])
def test_batched_streams_give_the_tokens_they_give_alone(
    stages: int, paged: dict[int, PagedChain], prompts: list[list[int]]
) -> None:
    """Streams join at random steps, prompts go in 16-token chunks beside other streams'
    decode steps, and shorter requests leave early: every stream's tokens are those it
    makes alone, in the default precision."""
    chain = paged[stages]
    alone = {i: _greedy_one(chain, p, TOKENS) for i, p in enumerate(prompts)}
    rng = np.random.default_rng(stages)
    worst = 0.0
    for users in (2, 4, 8):
        reqs = {
            i: Request(prompts[i], TOKENS if i == 0 else int(rng.integers(8, TOKENS + 1)), int(rng.integers(0, 10)))
            for i in range(users)
        }
        reqs[0].join = 0
        greedy(chain, reqs, keep_logits=True)
        for i, r in reqs.items():
            assert r.tokens == alone[i].tokens[: r.max_tokens], f"stream {i} of {users}"
            worst = max(worst, *(float(np.abs(a - b).max()) for a, b in zip(r.logits, alone[i].logits, strict=False)))
        assert chain.free_blocks == 128  # every stream's blocks came back
    report(f"paged, {stages} stage(s): batched (2/4/8 users) vs alone, max |logit diff| {worst:.2e}, tokens identical")


def test_rollback_then_refeed_equals_never_having_fed(paged: dict[int, PagedChain], prompts: list[list[int]]) -> None:
    """Rejected speculative tokens, rolled back across a block boundary, leave no trace."""
    chain = paged[2]
    prompt = prompts[0][:30]  # 30 tokens: 5 junk tokens spill into a second block
    junk = np.array([9, 99, 999, 1234, 77], dtype=np.int64)
    want = _greedy_one(chain, prompt, 12)
    chain.open_stream(5)
    first = chain.step([Entry(5, np.asarray(prompt, dtype=np.int64))])
    before = chain.free_blocks
    chain.step([Entry(5, junk, 5)])
    assert chain.free_blocks == before - 1
    chain.rollback(5, 5)
    assert chain.free_blocks == before and chain.stages[0].length(5) == 30
    assert first.token_ids is not None
    toks, logits = [int(first.token_ids[-1])], []
    while len(toks) < 12:
        res = chain.step([Entry(5, np.array([toks[-1]], dtype=np.int64))])
        assert res.token_ids is not None and res.logits is not None
        toks.append(int(res.token_ids[-1]))
        logits.append(res.logits[-1])
    chain.close_stream(5)
    assert toks == want.tokens
    assert all(np.array_equal(a, b) for a, b in zip(logits, want.logits[1:], strict=True))


def test_pool_exhaustion_is_a_clear_error_that_changes_nothing(exports: dict[int, Path]) -> None:
    stage = PagedStage(exports[1] / "stage_0", device="CPU", threads=1, num_blocks=3)
    assert (stage.free_blocks, stage.block_size) == (3, 32)
    ids = np.arange(100, 150, dtype=np.int64)  # 50 tokens: 2 blocks
    stage.open_stream(1)
    stage.open_stream(2)
    want = stage.step([Entry(1, ids)])
    with pytest.raises(PoolExhausted, match="needs 2 more block"):
        stage.step([Entry(1, ids[:1]), Entry(2, ids)])
    assert stage.free_blocks == 1 and stage.length(1) == 50 and stage.length(2) == 0
    stage.close_stream(1)  # the waiting stream fits once another leaves
    got = stage.step([Entry(2, ids)])
    assert got.token_ids is not None and want.token_ids is not None
    assert got.token_ids.tolist() == want.token_ids.tolist()
    stage.close_stream(2)
    assert stage.free_blocks == 3


def test_bad_steps_are_clear_errors_and_the_other_streams_continue(
    paged: dict[int, PagedChain], prompts: list[list[int]]
) -> None:
    chain = paged[1]
    stage = chain.stages[0]
    stage.max_step_tokens = 64
    want = _greedy_one(chain, prompts[1], 4).tokens
    chain.open_stream(1)
    first = chain.step([Entry(1, np.asarray(prompts[1], dtype=np.int64))])
    assert first.token_ids is not None
    toks = [int(first.token_ids[-1])]
    last = np.array([toks[-1]], dtype=np.int64)
    bad = {
        "unknown stream 42": [Entry(1, last), Entry(42, last)],
        "twice": [Entry(1, last), Entry(1, last)],
        "out of range": [Entry(1, np.array([10**6], dtype=np.int64))],
        "int64 \\[n\\]": [Entry(1, last.astype(np.int32))],
        "2 logits asked of 1": [Entry(1, last, 2)],
        "empty step": [],
        "over this stage's budget of 64": [Entry(1, last), Entry(2, np.ones(64, dtype=np.int64))],
    }
    for message, entries in bad.items():
        with pytest.raises(StageError, match=message):
            stage.step(entries)
    assert stage.length(1) == len(prompts[1])
    while len(toks) < 4:
        res = chain.step([Entry(1, np.array([toks[-1]], dtype=np.int64))])
        assert res.token_ids is not None
        toks.append(int(res.token_ids[-1]))
    chain.close_stream(1)
    stage.max_step_tokens = None
    assert toks == want and chain.free_blocks == 128


@pytest.fixture
def attentionless_stage(exports: dict[int, Path], tmp_path: Path) -> Iterator[Path]:
    """A stage dir whose model has no attention for the paged rewrite to convert."""
    d = tmp_path / "stage_0"
    d.mkdir()
    manifest = json.loads((exports[1] / "stage_0" / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps(manifest))
    ids = ops.parameter(ov.PartialShape([-1, -1]), ov.Type.i64, name="input_ids")
    ids.output(0).get_tensor().set_names({"input_ids"})
    ov.save_model(ov.Model([ops.convert(ids, "f32")], [ids]), str(d / "model.xml"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_stage_that_cannot_run_paged_says_so(attentionless_stage: Path) -> None:
    with pytest.raises(PagedUnavailable, match="stage 0"):
        PagedStage(attentionless_stage, device="CPU")


def test_an_agent_set_to_paged_runs_a_stage_that_cannot_stateful_and_says_why(attentionless_stage: Path) -> None:
    from agent.runtime.stage import Stage
    from agent.security.transport import PLAINTEXT
    from agent.serving.stage_host import StageHost

    host = StageHost(transport=PLAINTEXT, device="CPU", attention="paged")
    try:
        stage = host._compile(attentionless_stage, False)
    finally:
        host.shutdown()
    assert isinstance(stage, Stage)
    assert "stage 0 does not compile paged on CPU" in (host.attention_fallback(attentionless_stage) or "")
