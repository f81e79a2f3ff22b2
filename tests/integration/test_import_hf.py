"""A local Hugging Face directory (safetensors) imports and exports like the GGUF it came from."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from agent.export.exporter import ExportOptions, export_model
from agent.models.store import ModelStore
from agent.runtime.chain import Chain
from tests.support.prompts import PROMPTS


@pytest.fixture(scope="module")
def hf_dir(hf_smollm2, smollm2, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("hf") / "SmolLM2-135M-Instruct"
    # save_pretrained refuses GGUF-quantized models; the weights are already dequantized
    hf_smollm2.hf_quantizer = None
    hf_smollm2.config.quantization_config = None
    if hasattr(hf_smollm2.config, "quantization_config"):
        del hf_smollm2.config.quantization_config
    hf_smollm2.save_pretrained(str(d))
    AutoTokenizer.from_pretrained(str(smollm2.tokenizer_dir)).save_pretrained(str(d))
    yield d
    shutil.rmtree(d.parent, ignore_errors=True)  # 0.5 GB of f32 safetensors


def test_hf_directory_export_matches_hugging_face(hf_dir: Path, hf_smollm2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = ModelStore(tmp_path / "models")
    model = store.import_path(hf_dir, quiet=True)
    assert model.source == "hf-dir" and model.name == "smollm2-135m-instruct"
    assert store.resolve(str(hf_dir)) == model  # pointing at the same directory again reuses the import
    res = export_model(
        model, [(0, 12), (12, 30)], ExportOptions(weights="fp32"), tmp_path / "exp", isolate=True, quiet=True
    )
    chain = Chain.load(res.dir, device="CPU", exact=True)
    from agent.runtime.tokenizer import ChatTokenizer

    tok = ChatTokenizer(res.dir / "tokenizer", res.dir / "config.json")
    ids = tok.chat_ids([{"role": "user", "content": PROMPTS[1]}])
    g = chain.generate(ids, max_tokens=32, keep_logits=True)
    seq = torch.tensor([ids + g.tokens[:-1]])
    with torch.no_grad():
        ref = hf_smollm2(seq).logits[0, len(ids) - 1 :].numpy()
    assert g.tokens == [int(t) for t in ref.argmax(-1)]
    assert float(np.abs(np.stack(g.logits) - ref).max()) < 2e-3
