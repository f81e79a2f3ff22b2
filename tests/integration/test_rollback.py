"""Mask rollback on a real stateful stage: equal to physically trimming the KV cache."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent.runtime.stage import Stage, Stream, should_compact
from tests.support.figures import report


@pytest.fixture(scope="module")
def fp32_stage(smollm2, export_root: Path) -> Iterator[Stage]:  # type: ignore[no-untyped-def]
    from agent.export.exporter import ExportOptions, export_model

    out = export_root / "fp32-rollback"
    res = export_model(smollm2, [(0, smollm2.num_layers)], ExportOptions(weights="fp32"), out, quiet=True)
    yield Stage(res.stage_dirs()[0], device="CPU", exact=True)
    shutil.rmtree(out, ignore_errors=True)  # 0.5 GB of f32 weights


def _feed(stage: Stage, st: Stream, ids: list[int]) -> np.ndarray:
    out = stage.forward(st, np.asarray(ids, dtype=np.int64)[None, :])
    assert out.logits is not None
    return np.array(out.logits[-1], copy=True)


def _greedy(stage: Stage, st: Stream, first: int, n: int) -> tuple[list[int], list[np.ndarray]]:
    toks, logits, tok = [], [], first
    for _ in range(n):
        lg = _feed(stage, st, [tok])
        tok = int(np.argmax(lg))
        toks.append(tok)
        logits.append(lg)
    return toks, logits


PROMPT = [1, 504, 3458, 282, 4649, 314, 3840, 30, 378, 2313]
JUNK = [9, 99, 999, 1234, 77]


def test_mask_rollback_equals_physical_trim(fp32_stage: Stage) -> None:
    stage = fp32_stage
    ref, masked, trimmed = stage.open_stream(), stage.open_stream(), stage.open_stream()
    for st in (ref, masked, trimmed):
        st.reset()
        _feed(stage, st, PROMPT)
    # two rounds of rejected speculative tokens, of different lengths
    for r in (5, 3):
        _feed(stage, masked, JUNK[:r])
        masked.rollback(r)
        _feed(stage, trimmed, JUNK[:r])
        trimmed.trim(r)
    assert masked.pos == trimmed.pos == ref.pos == len(PROMPT)
    assert masked.phys == len(PROMPT) + 8 and trimmed.phys == len(PROMPT)
    want_toks, want = _greedy(stage, ref, 13, 24)
    got_toks, got = _greedy(stage, masked, 13, 24)
    trim_toks, trim = _greedy(stage, trimmed, 13, 24)
    assert got_toks == want_toks == trim_toks
    scale = max(float(np.abs(a).max()) for a in want)
    diff_trim = max(float(np.abs(a - b).max()) for a, b in zip(got, trim, strict=True))
    diff_ref = max(float(np.abs(a - b).max()) for a, b in zip(got, want, strict=True))
    assert max(float(np.abs(a - b).max()) for a, b in zip(trim, want, strict=True)) == 0.0
    # A masked slot moves every later token one physical slot on, so the attention kernel
    # sums in another order: that f32 rounding (about 1e-6 of the logits' size, the same
    # as between any two shapes of this model) is all that separates the two.
    assert diff_trim <= 1e-5 * scale
    report(
        f"mask rollback vs physical trim, 24 tokens: max |logit diff| {diff_trim:.2e} "
        f"({diff_trim / scale:.1e} of the largest logit {scale:.1f}; vs never having the junk {diff_ref:.2e})"
    )


def test_compaction_changes_no_output(fp32_stage: Stage) -> None:
    stage = fp32_stage
    ref, st = stage.open_stream(), stage.open_stream()
    for s in (ref, st):
        s.reset()
        _feed(stage, s, PROMPT)
    _feed(stage, st, JUNK)
    st.rollback(4)  # keep the first junk token: then the reference must have it too
    _feed(stage, ref, JUNK[:1])
    assert st.masked_slots() == 4
    st.compact()
    assert st.masked_slots() == 0 and st.phys == len(PROMPT) + 1 and st.pos == ref.pos
    want_toks, want = _greedy(stage, ref, 21, 16)
    got_toks, got = _greedy(stage, st, 21, 16)
    assert got_toks == want_toks
    scale = max(float(np.abs(a).max()) for a in want)
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, want, strict=True)) <= 1e-5 * scale


def test_a_bad_rollback_is_refused(fp32_stage: Stage) -> None:
    from agent.runtime.stage import StageError

    st = fp32_stage.open_stream()
    st.reset()
    _feed(fp32_stage, st, PROMPT[:3])
    with pytest.raises(StageError):
        st.rollback(4)
    with pytest.raises(StageError):
        st.trim(-1)
    assert st.pos == 3


@pytest.mark.parametrize(
    ("phys", "masked", "compact"),
    [(100, 0, False), (100, 30, False), (400, 64, False), (256, 64, True), (1000, 600, True), (40, 30, False)],
)
def test_compaction_policy(phys: int, masked: int, compact: bool) -> None:
    assert should_compact(phys, masked) is compact


def test_a_model_per_stream_stage_steps_streams_in_turn_and_reuses_closed_streams_models(fp32_stage: Stage) -> None:
    """The GPU's way (each stream its own compiled model; see device_profile.model_per_stream),
    run here on the CPU: streams stepped in turn give their solo tokens, and a closed stream's
    compiled model serves the next stream instead of a new compile."""
    import gc

    stage = Stage(fp32_stage.dir, device="CPU", exact=True, per_stream=True)
    prompts = [[1, 504, 3575, 28, 357], [1, 1073, 314, 260, 1789, 30], [1, 22, 7, 9]]
    solo = []
    for p in prompts:
        st = fp32_stage.open_stream()
        st.reset()
        first = int(np.argmax(_feed(fp32_stage, st, p)))
        solo.append([first, *_greedy(fp32_stage, st, first, 8)[0]])
    streams = [stage.open_stream() for _ in prompts]
    assert stage.models_compiled == 3 and len({id(s.request) for s in streams}) == 3
    toks = []
    for st, p in zip(streams, prompts, strict=True):
        st.reset()
        toks.append([int(np.argmax(_feed(stage, st, p)))])
    for _ in range(8):
        for st, t in zip(streams, toks, strict=True):
            t.append(int(np.argmax(_feed(stage, st, [t[-1]]))))
    assert toks == solo
    del streams, st
    gc.collect()
    again = stage.open_stream()  # a model given back by a closed stream: no compile
    again.reset()
    first = int(np.argmax(_feed(stage, again, prompts[0])))
    assert stage.models_compiled == 3 and [first, *_greedy(stage, again, first, 8)[0]] == solo[0]
