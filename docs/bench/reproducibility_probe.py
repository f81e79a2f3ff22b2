"""Verify-style (5 rows a call) vs 1-row steps: logits drift and greedy mismatches; 2-thread speed."""

import json
import statistics
import sys
from pathlib import Path

import numpy as np

import agent.runtime.stage as _stm
from agent.export.exporter import ExportOptions, export_model
from agent.models.store import ModelStore
from agent.runtime.stage import Stage
from agent.runtime.tokenizer import ChatTokenizer
from coordinator.bench.paged_probe import TEXTS, stateful_decode

name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b"
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
model = ModelStore().resolve(name, quiet=True)
sd = Path(export_model(model, [(0, model.num_layers)], ExportOptions(weights="int4"), quiet=True).dir) / "stage_0"
tok = ChatTokenizer(model.tokenizer_dir, model.dir / "config.json")
prompts = [list(map(int, tok.chat_ids([{"role": "user", "content": TEXTS[i % len(TEXTS)]}]))) for i in range(8)]
variants = {
    "f16kv": {},
    "f32kv": dict(kv_precision="f32"),
    "exact": dict(exact=True),
    "f32kv_dq0": dict(kv_precision="f32", props={"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),
}
_orig = _stm.compile_properties


def mk(v):
    _stm.compile_properties = lambda *a, **kw: {**_orig(*a, **kw), **(v.get("props") or {})}
    try:
        return Stage(sd, device="CPU", threads=threads, kv_precision=v.get("kv_precision"), exact=v.get("exact", False))
    finally:
        _stm.compile_properties = _orig


st = {k: mk(v) for k, v in variants.items()}
T = 64


def drift(stage, p):
    s = stage.open_stream()
    out = stage.forward(s, np.asarray(p, dtype=np.int64)[None, :])
    toks, logs = [int(out.token_ids[-1])], []
    for _ in range(T):
        o = stage.forward(s, np.array([[toks[-1]]], dtype=np.int64))
        logs.append(np.array(o.logits[-1]))
        toks.append(int(o.token_ids[-1]))
    s = stage.open_stream()
    stage.forward(s, np.asarray(p, dtype=np.int64)[None, :])
    vlogs = []
    for c in range(0, T, 5):
        ch = toks[c : c + 5]
        o = stage.forward(s, np.asarray(ch, dtype=np.int64)[None, :], logits_idx=np.arange(len(ch), dtype=np.int64))
        vlogs.extend([np.array(x) for x in o.logits])
    d = max(float(np.abs(a - b).max()) for a, b in zip(logs, vlogs, strict=False))
    mism = sum(int(np.argmax(a) != np.argmax(b)) for a, b in zip(logs, vlogs, strict=False))
    return d, mism


res = {}
for k in variants:
    ds = [drift(st[k], p) for p in prompts]
    res[k] = {"max_logit_diff": round(max(d for d, _ in ds), 5), "argmax_mismatch_positions": sum(m for _, m in ds)}
    print(k, res[k], flush=True)
sp = {k: [] for k in variants}
for r in range(4):
    for k in variants:
        t, _ = stateful_decode(st[k], prompts[r : r + 1], 128)
        sp[k].append(round(127 / t, 2))
    print(r, {k: v[-1] for k, v in sp.items()}, flush=True)
print(
    json.dumps(
        {"threads": threads, "drift": res, "s1_tok_s": sp, "median": {k: statistics.median(v) for k, v in sp.items()}}
    )
)
