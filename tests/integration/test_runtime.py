"""The stage runtime: bad input is refused without disturbing the stream; seeded runs repeat."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.runtime.chain import Chain
from agent.runtime.sampling import Sampling
from agent.runtime.stage import StageError
from tests.support.cli import run_cli
from tests.support.prompts import PROMPTS


@pytest.fixture(scope="module")
def chain2(int4_exports: dict[int, Path]) -> Chain:
    return Chain.load(int4_exports[2], device="CPU")


def test_bad_inputs_are_refused_and_the_stream_carries_on(chain2: Chain, smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = smollm2_tokenizer.chat_ids([{"role": "user", "content": PROMPTS[0]}])
    expected = chain2.generate(ids, max_tokens=24).tokens

    streams = chain2.open_streams()
    first, second = chain2.stages
    bad_calls = [
        lambda: first.forward(streams[0], np.array([[1.5, 2.5]], dtype=np.float32)),  # wrong dtype
        lambda: first.forward(streams[0], np.array([1, 2], dtype=np.int64)),  # wrong rank
        lambda: first.forward(streams[0], np.array([[10**9]], dtype=np.int64)),  # token id out of range
        lambda: first.forward(streams[0], np.zeros((1, 0), dtype=np.int64)),  # no tokens
        lambda: second.forward(streams[1], np.zeros((1, 2, 7), dtype=np.float32)),  # wrong hidden size
        lambda: second.forward(streams[1], np.zeros((1, 2, 576), dtype=np.float16)),  # wrong dtype
        lambda: second.forward(
            streams[1], np.zeros((1, 2, 576), dtype=np.float32), logits_idx=np.array([5], dtype=np.int64)
        ),
        lambda: streams[0].rollback(3),  # nothing to roll back yet
    ]
    for call in bad_calls:
        with pytest.raises(StageError):
            call()
    assert all(s.phys == 0 and s.pos == 0 for s in streams)
    # the same stream objects then generate exactly what a fresh stream does
    assert chain2.generate(ids, max_tokens=24, streams=streams).tokens == expected


def test_seeded_sampling_repeats_and_seeds_differ(chain2: Chain, smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = smollm2_tokenizer.chat_ids([{"role": "user", "content": "Write a short poem about the sea."}])
    s7 = Sampling(temperature=1.0, top_p=0.95, seed=7)
    a = chain2.generate(ids, max_tokens=32, sampling=s7).tokens
    b = chain2.generate(ids, max_tokens=32, sampling=s7).tokens
    c = chain2.generate(ids, max_tokens=32, sampling=Sampling(temperature=1.0, top_p=0.95, seed=8)).tokens
    assert a == b
    assert a != c


def test_generate_command_answers_a_chat(smollm2) -> None:  # type: ignore[no-untyped-def]
    r = run_cli("generate", "smollm2-135m", "--stages", "2", "--prompt", "What is the capital of France?", "--stats")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
    assert "2 stages on CPU" in r.stderr
