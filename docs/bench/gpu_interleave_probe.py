"""Why do three streams stepped in turn on one GPU stage differ from their solo runs?

Run on the lent device machine (OpenVINO's GPU plugin over PoCL) after gpu_run.sh's setup, extra
and model phases:  python3 docs/bench/gpu_interleave_probe.py [DEVICE ...]

Variants, each on a fresh Stage (1-stage SmolLM2 INT8 export, exact mode), 3 prompts x 16 tokens:
  solo      each stream alone, twice (is a solo run even repeatable?)
  turns     three streams stepped in turn (tests/test_gpu.py's scenario)
  keep      turns, every input array kept alive until the end (a freed input buffer re-read?)
  copies    turns, inputs copied into tensors OpenVINO owns (no shared host memory)
  own-models  turns, each stream on a compiled model of its own
  (NUM_STREAMS=3 on one compiled model was tried too: the GPU plugin refused the value)
One JSON line per device and variant: the first differing token per stream against solo.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

import agent.runtime.stage as stage_mod
from agent.export.exporter import ExportOptions, export_model
from agent.models.store import ModelStore
from agent.runtime.stage import Stage
from agent.runtime.tokenizer import ChatTokenizer
from coordinator.planning.planner import balanced_split, model_costs

PROMPTS = [
    "What is the capital of France? Tell me about the city.",
    "Write a short Python function that checks whether a number is prime.",
    "List three tips for staying focused while working from home.",
]
N = 16
KEEP: list[Any] = []


class _Ov:
    """``ov`` as the stage module sees it, with Tensor replaced."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __getattr__(self, name: str) -> Any:
        return getattr(ov, name)

    def Tensor(self, a: Any, shared_memory: bool = False) -> ov.Tensor:
        if self.mode == "copies" and isinstance(a, np.ndarray):
            return ov.Tensor(np.array(a, copy=True))
        if self.mode == "keep" and isinstance(a, np.ndarray):
            KEEP.append(a)
        return ov.Tensor(a, shared_memory=shared_memory)


def first_token(stage: Stage, st: Any, ids: list[int]) -> int:
    out = stage.forward(st, np.asarray(ids, dtype=np.int64)[None, :])
    assert out.logits is not None
    return int(np.argmax(out.logits[-1]))


def solo(stage: Stage, prompts: list[list[int]]) -> list[list[int]]:
    runs = []
    for p in prompts:
        st = stage.open_stream()
        st.reset()
        toks = [first_token(stage, st, p)]
        for _ in range(N):
            toks.append(first_token(stage, st, [toks[-1]]))
        runs.append(toks)
    return runs


def turns(stage: Stage, prompts: list[list[int]]) -> list[list[int]]:
    streams = [stage.open_stream() for _ in prompts]
    toks = []
    for st, p in zip(streams, prompts, strict=True):
        st.reset()
        toks.append([first_token(stage, st, p)])
    for _ in range(N):
        for st, t in zip(streams, toks, strict=True):
            t.append(first_token(stage, st, [t[-1]]))
    return toks


def turns_own_models(d: Path, dev: str, prompts: list[list[int]]) -> list[list[int]]:
    """As ``turns``, each stream on a compiled model of its own."""
    stages = [Stage(d, device=dev, exact=True) for _ in prompts]
    streams = [s.open_stream() for s in stages]
    toks = []
    for stage, st, p in zip(stages, streams, prompts, strict=True):
        st.reset()
        toks.append([first_token(stage, st, p)])
    for _ in range(N):
        for stage, st, t in zip(stages, streams, toks, strict=True):
            t.append(first_token(stage, st, [t[-1]]))
    return toks


def diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> None:
    devices = sys.argv[1:] or ["GPU", "CPU"]
    entry = ModelStore().resolve("smollm2-135m", quiet=True)
    tok = ChatTokenizer(entry.tokenizer_dir, entry.dir / "config.json")
    prompts = [tok.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    with tempfile.TemporaryDirectory() as tmp:
        exp = export_model(
            entry, balanced_split(model_costs(entry.config()), 1), ExportOptions(weights="int8"), Path(tmp), quiet=True
        )
        d = exp.stage_dirs()[0]
        for dev in devices:
            base = solo(Stage(d, device=dev, exact=True), prompts)
            again = solo(Stage(d, device=dev, exact=True), prompts)
            print(
                json.dumps(
                    {
                        "device": dev,
                        "variant": "solo-again",
                        "first_diff": [diff(a, b) for a, b in zip(again, base, strict=True)],
                    }
                ),
                flush=True,
            )
            own = turns_own_models(d, dev, prompts)
            print(
                json.dumps(
                    {
                        "device": dev,
                        "variant": "own-models",
                        "first_diff": [diff(a, b) for a, b in zip(own, base, strict=True)],
                    }
                ),
                flush=True,
            )
            for mode in ("turns",):
                stage_mod.ov = _Ov(mode)  # type: ignore[assignment]
                got = turns(Stage(d, device=dev, exact=True), prompts)
                stage_mod.ov = ov
                KEEP.clear()
                print(
                    json.dumps(
                        {
                            "device": dev,
                            "variant": mode,
                            "first_diff": [diff(a, b) for a, b in zip(got, base, strict=True)],
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
