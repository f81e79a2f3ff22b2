"""Split parity: any chain of stages behaves exactly like the whole model and like Hugging Face."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from agent.export.exporter import ExportOptions, export_model
from agent.runtime.chain import Chain
from coordinator.planning.planner import balanced_split, model_costs
from tests.support.figures import report
from tests.support.prompts import PROMPTS

TOKENS = 64


@pytest.fixture(scope="module")
def fp32_exports(smollm2, export_root: Path):  # type: ignore[no-untyped-def]
    costs = model_costs(smollm2.config())
    out = {}
    for n in (1, 2, 3):
        ranges = balanced_split(costs, n)
        out[n] = export_model(
            smollm2,
            ranges,
            ExportOptions(weights="fp32"),
            export_root / f"fp32-{n}",
            isolate=False,
            quiet=True,
        )
    out["whole"] = export_model(
        smollm2,
        [(0, smollm2.num_layers)],
        ExportOptions(weights="fp32", genai=True),
        export_root / "fp32-whole",
        isolate=False,
        quiet=True,
    )
    yield out
    for res in out.values():  # 2 GB of f32 weights: gone before the next module
        shutil.rmtree(res.dir, ignore_errors=True)


def _hf_logits(hf, prompt: list[int], tokens: list[int]) -> np.ndarray:  # type: ignore[no-untyped-def]
    seq = torch.tensor([prompt + tokens[:-1]], dtype=torch.long)
    with torch.no_grad():
        return hf(seq).logits[0, len(prompt) - 1 :].float().numpy()


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_chains_equal_whole_model_and_hugging_face(fp32_exports, hf_smollm2, smollm2_tokenizer, prompt) -> None:  # type: ignore[no-untyped-def]
    ids = smollm2_tokenizer.chat_ids([{"role": "user", "content": prompt}])
    runs = {}
    for key, res in fp32_exports.items():
        chain = Chain.load(res.dir, device="CPU", exact=True)
        assert len(chain.stages) == (1 if key == "whole" else key)
        runs[key] = chain.generate(ids, max_tokens=TOKENS, keep_logits=True)
    whole = runs["whole"]
    assert len(whole.tokens) == TOKENS
    hf_logits = _hf_logits(hf_smollm2, ids, whole.tokens)
    hf_tokens = [int(t) for t in hf_logits.argmax(-1)]
    assert whole.tokens == hf_tokens, "whole-model IR diverged from Hugging Face greedy decoding"
    for n in (1, 2, 3):
        assert runs[n].tokens == whole.tokens, f"{n}-stage chain diverged from the whole-model IR"
        diff_hf = float(np.abs(np.stack(runs[n].logits) - hf_logits).max())
        diff_whole = float(np.abs(np.stack(runs[n].logits) - np.stack(whole.logits)).max())
        report(
            f"parity fp32 {n}-stage chain ({prompt[:24]}...): {TOKENS} tokens identical to HF and whole IR; "
            f"max |logit diff| vs HF {diff_hf:.2e}, vs whole IR {diff_whole:.2e}"
        )
        assert diff_hf < 2e-3
        assert diff_whole < 1e-3
