"""INT4 (NNCF sym, all layers): a 2-stage split gives exactly what the 1-stage IR gives."""

from __future__ import annotations

import json
from pathlib import Path

from agent.runtime.chain import Chain
from tests.support.figures import report
from tests.support.prompts import PROMPTS


def test_int4_manifest_describes_the_stage(int4_exports: dict[int, Path], smollm2) -> None:  # type: ignore[no-untyped-def]
    mans = [json.loads((int4_exports[2] / f"stage_{i}" / "manifest.json").read_text()) for i in range(2)]
    assert mans[0]["stage"]["layer_start"] == 0
    assert mans[0]["stage"]["layer_end"] == mans[1]["stage"]["layer_start"]
    assert mans[1]["stage"]["layer_end"] == smollm2.num_layers
    for m in mans:
        assert m["model"]["sha256"] == smollm2.sha256
        assert m["compression"] == {
            "weights": "int4",
            "mode": "int4_sym",
            "group_size": 128,
            "all_layers": True,
        }
        assert m["beam_idx"] is True
        assert {i["name"] for i in m["inputs"]} >= {"attention_mask", "position_ids", "beam_idx"}
        # each end of the split holds a part of the vocabulary head, its own files verified alike
        assert set(m["files"]) == {"model.xml", "model.bin", "head.xml", "head.bin"}
    assert mans[0]["inputs"][0]["name"] == "input_ids"
    assert mans[1]["inputs"][0]["name"] == "hidden_states"
    assert {o["name"] for o in mans[1]["outputs"]} >= {"logits", "token_ids", "hidden_states_out"}
    vocab = mans[0]["vocab_size"]
    (a0, b0), (a1, b1) = mans[0]["head_part"]["rows"], mans[1]["head_part"]["rows"]
    assert a0 == 0 and b0 == a1 and b1 == vocab and 0 < b0 < vocab / 2
    report(f"int4 2-stage export: peak RSS per stage export {[m['export_peak_rss_mb'] for m in mans]} MB")


def test_int4_two_stages_equal_one(int4_exports: dict[int, Path], smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    # f32 activations: the INT4 weights are what is compared. (With bf16 activations, as the CPU
    # plugin picks on AMX machines, it keeps a stage's residual stream in f32 up to its f32 output,
    # so a split rounds differently from the whole model; `lakeshard bench parity` reports that.)
    one = Chain.load(int4_exports[1], device="CPU", exact=True)
    two = Chain.load(int4_exports[2], device="CPU", exact=True)
    for prompt in PROMPTS:
        ids = smollm2_tokenizer.chat_ids([{"role": "user", "content": prompt}])
        a = one.generate(ids, max_tokens=64).tokens
        b = two.generate(ids, max_tokens=64).tokens
        assert len(a) == 64
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        assert a == b, f"2-stage INT4 diverged from 1-stage at token {first_diff}"
