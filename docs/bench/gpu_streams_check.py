"""Streams stepped in turn on one GPU stage, with the stage as the agent builds it now.

Run on the lent device machine after gpu_run.sh's setup phase (no model store needed: random
weights from the bundled SmolLM2 config, std --init-range so that greedy tokens vary):

    python3 docs/bench/gpu_streams_check.py [--init-range 0.4] [--tokens 24] [DEVICE]

One Stage (1-stage INT8 export, exact mode) on DEVICE (GPU by default): three streams, each alone,
then the three stepped in turn, once with the device's default (a compiled model per stream on
the GPU, ``device_profile.model_per_stream``) and once with every stream on the one compiled
model. One JSON line per variant: the first token where each interleaved stream differs from
its solo run (``--tokens`` where they agree throughout).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from agent.export.exporter import ExportOptions, export_model
from agent.models.store import LocalModel
from agent.runtime.stage import Stage
from coordinator.bench.pipeline import resolve_model, synthetic_ids
from coordinator.planning.planner import balanced_split, model_costs


def _step(stage: Stage, st: object, ids: list[int]) -> int:
    out = stage.forward(st, np.asarray(ids, dtype=np.int64)[None, :])  # type: ignore[arg-type]
    assert out.logits is not None
    return int(np.argmax(out.logits[-1]))


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("device", nargs="?", default="GPU")
    ap.add_argument("--init-range", type=float, default=0.4)
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    base = resolve_model("smollm2-135m", True, True)
    cfg = json.loads((base.dir / "config.json").read_text())
    cfg["initializer_range"] = args.init_range
    d = Path(tempfile.mkdtemp(prefix="gpu-streams-")) / "smollm2-135m"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    model = LocalModel.synthetic(d, "smollm2-135m")
    ex = export_model(model, balanced_split(model_costs(model.config()), 1), ExportOptions(weights="int8"), quiet=True)
    prompts = [synthetic_ids(20 + 3 * i, 2000 + 500 * i) for i in range(3)]
    for per_stream in (None, False):
        stage = Stage(ex.stage_dirs()[0], device=args.device, exact=True, per_stream=per_stream)
        solo = []
        for p in prompts:
            st = stage.open_stream()
            st.reset()
            toks = [_step(stage, st, p)]
            for _ in range(args.tokens - 1):
                toks.append(_step(stage, st, [toks[-1]]))
            solo.append(toks)
        streams = [stage.open_stream() for _ in prompts]
        got = []
        for st, p in zip(streams, prompts, strict=True):
            st.reset()
            got.append([_step(stage, st, p)])
        for _ in range(args.tokens - 1):
            for st, t in zip(streams, got, strict=True):
                t.append(_step(stage, st, [t[-1]]))
        row = {
            "suite": "gpu_streams_check",
            "device": stage.device,
            "per_stream": stage.per_stream,
            "init_range": args.init_range,
            "tokens": args.tokens,
            "distinct_tokens_solo": len({t for s in solo for t in s}),
            "first_diff": [_first_diff(a, b) for a, b in zip(got, solo, strict=True)],
            "identical": got == solo,
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
