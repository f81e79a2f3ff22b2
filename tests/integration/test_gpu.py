"""Stages on OpenVINO's GPU plugin: the split is exact there, agrees with the CPU, and rolls back.

These run wherever OpenVINO lists a GPU: on an Intel laptop, and on the lent device machine
(an NVIDIA H200 through PoCL's OpenCL driver), where they were run for issue 25:

    python -m pytest tests/integration/test_gpu.py

On a machine without one (this project's CI: Debian's PoCL offers only a CPU OpenCL device,
which the GPU plugin does not take) they are skipped, each saying so.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.common import aio
from agent.runtime.chain import Chain
from agent.runtime.device import available_devices, choose_device
from agent.runtime.stage import Stage
from tests.support.figures import report

GPUS = [d for d in available_devices() if d.startswith("GPU")]
pytestmark = pytest.mark.skipif(not GPUS, reason="OpenVINO lists no GPU here (CPU-only machine)")

TOKENS = 32
PROMPTS = [
    "What is the capital of France? Tell me about the city.",
    "Write a short Python function that checks whether a number is prime.",
    "List three tips for staying focused while working from home.",
    "Explain what a hash table is to a new programmer.",
    "Summarise the water cycle in four sentences.",
    "Give me a haiku about autumn rain.",
    "How do I reverse a linked list in C?",
    "What are the pros and cons of remote work?",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Describe a lighthouse at night.",
]


@pytest.fixture(scope="module")
def exports(smollm2, export_root: Path) -> Iterator[dict[int, Any]]:  # type: ignore[no-untyped-def]
    from agent.export.exporter import ExportOptions, export_model
    from coordinator.planning.planner import balanced_split, model_costs

    costs = model_costs(smollm2.config())
    out = {
        n: export_model(smollm2, balanced_split(costs, n), ExportOptions(weights="int8"), quiet=True) for n in (1, 2)
    }
    yield out


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [smollm2_tokenizer.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_auto_picks_the_gpu() -> None:
    assert choose_device("AUTO") == GPUS[0]
    assert choose_device("gpu") == "GPU"


def test_split_on_the_gpu_equals_the_whole_model_on_the_gpu(exports, prompts) -> None:  # type: ignore[no-untyped-def]
    whole = Chain.load(exports[1].dir, device="GPU", exact=True)
    two = Chain.load(exports[2].dir, device="GPU", exact=True)
    assert [s.device for s in two.stages] == ["GPU", "GPU"]
    for p in prompts:
        a = whole.generate(p, max_tokens=TOKENS).tokens
        b = two.generate(p, max_tokens=TOKENS).tokens
        assert a == b, f"prompt {p[:8]}...: 2 GPU stages differ from the whole model at token {_first_diff(a, b)}"
    report(f"GPU: 2 stages == whole model on the GPU, {len(prompts)} prompts x {TOKENS} tokens (exact INT8)")


def test_gpu_pipeline_agrees_with_the_cpu_pipeline(exports, prompts) -> None:  # type: ignore[no-untyped-def]
    gpu = Chain.load(exports[2].dir, device="GPU", exact=True)
    cpu = Chain.load(exports[2].dir, device="CPU", exact=True)
    firsts, gaps = [], []
    for p in prompts:
        g = gpu.generate(p, max_tokens=TOKENS, keep_logits=True)
        c = cpu.generate(p, max_tokens=TOKENS, keep_logits=True)
        firsts.append(_first_diff(g.tokens, c.tokens))
        # the same f32 logits up to the devices' summation order
        n = firsts[-1]
        gaps += [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(g.logits[:n], c.logits[:n], strict=True)]
    assert min(firsts) >= TOKENS, f"first differing token per prompt: {firsts}"
    assert max(gaps) < 1e-3, gaps
    report(
        f"GPU vs CPU, 2 stages, {len(prompts)} prompts: identical for {TOKENS} tokens; "
        f"prompt logits differ by at most {max(gaps):.1e} of the largest"
    )


@pytest.fixture(scope="module")
def gpu_stage(exports) -> Stage:  # type: ignore[no-untyped-def]
    return Stage(exports[1].stage_dirs()[0], device="GPU", exact=True)


def _feed(stage: Stage, st: Any, ids: list[int]) -> np.ndarray:
    out = stage.forward(st, np.asarray(ids, dtype=np.int64)[None, :])
    assert out.logits is not None
    return np.array(out.logits[-1], copy=True)


def _greedy(stage: Stage, st: Any, tok: int, n: int) -> tuple[list[int], list[np.ndarray]]:
    toks, lgs = [], []
    for _ in range(n):
        lg = _feed(stage, st, [tok])
        tok = int(np.argmax(lg))
        toks.append(tok)
        lgs.append(lg)
    return toks, lgs


JUNK = [9, 99, 999, 1234, 77]


def _scenario(stage: Stage, prompt: list[int], how: str) -> tuple[list[int], list[np.ndarray]]:
    """One stream on its own: the prompt, two rounds of rejected draft tokens undone by ``how``
    (none: never fed), then 24 greedy tokens."""
    st = stage.open_stream()
    st.reset()
    _feed(stage, st, prompt)
    for r in (5, 3):
        if how == "none":
            continue
        _feed(stage, st, JUNK[:r])
        if how == "masked":
            st.rollback(r)
        else:
            st.trim(r)
    if how == "masked":
        assert st.phys == len(prompt) + 8
    else:
        assert st.phys == len(prompt)
    return _greedy(stage, st, 13, 24)


def test_mask_rollback_on_a_gpu_stage_equals_a_physical_trim(gpu_stage: Stage, prompts) -> None:  # type: ignore[no-untyped-def]
    """Each way of undoing rejected draft tokens runs on a stream of its own, one after the other:
    the masked stream, the trimmed one and one that never saw the junk give the same tokens."""
    stage = gpu_stage
    outs = {how: _scenario(stage, prompts[0], how) for how in ("none", "masked", "trimmed")}
    scale = max(float(np.abs(a).max()) for a in outs["none"][1])

    def gap(a: str, b: str) -> float:
        n = _first_diff(outs[a][0], outs[b][0])
        return max(float(np.abs(x - y).max()) for x, y in zip(outs[a][1][: n + 1], outs[b][1][: n + 1], strict=True))

    facts = (
        f"first differing token: masked vs never-fed {_first_diff(outs['masked'][0], outs['none'][0])}, "
        f"trimmed vs never-fed {_first_diff(outs['trimmed'][0], outs['none'][0])}; max |logit diff| up to it: "
        f"masked/trimmed {gap('masked', 'trimmed'):.2e}, masked/never {gap('masked', 'none'):.2e}, "
        f"trimmed/never {gap('trimmed', 'none'):.2e}, of {scale:.1f}"
    )
    assert outs["trimmed"][0] == outs["none"][0], facts
    assert outs["masked"][0] == outs["trimmed"][0], facts
    assert gap("masked", "trimmed") <= 1e-4 * scale, facts
    report(f"GPU: mask rollback vs physical trim, 24 tokens identical; {facts}")


def test_streams_interleaved_on_a_gpu_stage_equal_their_solo_runs(gpu_stage: Stage, prompts) -> None:  # type: ignore[no-untyped-def]
    """Micro-batching on the GPU: three streams (each its own InferRequest and KV state) stepped
    in turn give each the tokens it gets alone."""
    stage = gpu_stage
    solo = []
    for p in prompts[:3]:
        st = stage.open_stream()
        st.reset()
        tok = int(np.argmax(_feed(stage, st, p)))
        solo.append([tok, *_greedy(stage, st, tok, 24)[0]])
    streams = [stage.open_stream() for _ in range(3)]
    toks = []
    for st, p in zip(streams, prompts[:3], strict=True):
        st.reset()
        toks.append([int(np.argmax(_feed(stage, st, p)))])
    for _ in range(24):
        for st, t in zip(streams, toks, strict=True):
            t.append(int(np.argmax(_feed(stage, st, [t[-1]]))))
    firsts = [_first_diff(a, b) for a, b in zip(toks, solo, strict=True)]
    assert toks == solo, f"first differing token per stream: {firsts}"
    report("GPU: 3 streams stepped in turn on one stage == each alone, 25 tokens")


_terms = itertools.count(1)


def test_a_mixed_cluster_gpu_then_cpu_answers_like_the_cpu_chain(smollm2, exports, prompts) -> None:  # type: ignore[no-untyped-def]
    """Two agent processes, the first serving its stage on the GPU, the second on CPU cores."""
    from coordinator.batching.scheduler import GenRequest
    from coordinator.lab.local_cluster import LocalCluster
    from coordinator.service.coordinator import Coordinator
    from tests.support.exact import exact_config

    want = Chain.load(exports[2].dir, device="CPU", exact=True).generate(prompts[3], max_tokens=TOKENS).tokens

    async def go(nodes: list[str]) -> tuple[list[int], list[str]]:
        coord = Coordinator(exact_config(smollm2, nodes, next(_terms) * 100 + 7000))
        await coord.async_start()
        try:
            assert coord.scheduler is not None and coord.pipeline is not None
            req = GenRequest(prompt=tuple(prompts[3]), max_tokens=TOKENS)
            out = [t async for t in coord.scheduler.async_generate(req)]
            return out, [a.device for a in coord.pipeline.assigned]
        finally:
            await coord.async_stop()

    with LocalCluster(2, device="GPU,CPU", attention="stateful") as c:  # as measured on the lent GPU
        got, devices = aio.run(go(c.nodes))
    assert devices == ["GPU", "CPU"]
    assert got == want
    report(f"mixed cluster (stage 0 on the GPU, stage 1 on CPU): {TOKENS} tokens, same as the CPU chain")
