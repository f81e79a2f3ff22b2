"""Speed and batch-independence of precision variants (issue 39 item 7)."""

import json
import sys
from pathlib import Path

import agent.runtime.stage as _stm
from agent.export.exporter import ExportOptions, export_model
from agent.models.store import ModelStore
from agent.runtime.paged import PagedStage
from agent.runtime.stage import Stage
from agent.runtime.tokenizer import ChatTokenizer
from coordinator.bench.paged_probe import TEXTS, paged_decode, stateful_decode

name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b"
weights = sys.argv[2] if len(sys.argv) > 2 else "int4"
model = ModelStore().resolve(name, quiet=True)
sd = Path(export_model(model, [(0, model.num_layers)], ExportOptions(weights=weights), quiet=True).dir) / "stage_0"
tok = ChatTokenizer(model.tokenizer_dir, model.dir / "config.json")
prompts = [list(map(int, tok.chat_ids([{"role": "user", "content": TEXTS[i % len(TEXTS)]}]))) for i in range(8)]
variants = {
    "f16kv": dict(),
    "f32kv": dict(kv_precision="f32"),
    "exact": dict(exact=True),
    "f16kv_dq0": dict(properties={"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),
}

_orig = _stm.compile_properties


def mk(v):
    _stm.compile_properties = lambda *a, **kw: {**_orig(*a, **kw), **(v.get("properties") or {})}
    try:
        return Stage(sd, device="CPU", threads=1, kv_precision=v.get("kv_precision"), exact=v.get("exact", False))
    finally:
        _stm.compile_properties = _orig


st = {k: mk(v) for k, v in variants.items()}
pg = {
    k: PagedStage(
        sd,
        device="CPU",
        threads=1,
        properties=v.get("properties"),
        kv_precision=v.get("kv_precision"),
        exact=v.get("exact", False),
    )
    for k, v in variants.items()
}
for k in variants:
    print(
        k,
        st[k].compiled.get_property("KV_CACHE_PRECISION"),
        st[k].compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE"),
        pg[k].kv_precision,
        flush=True,
    )
    stateful_decode(st[k], prompts[:1], 4)
    paged_decode(pg[k], prompts[:1], 4)
sp = {k: {"s1": [], "p1": [], "p8": []} for k in variants}
same = {}
T = 48
for r in range(3):
    for k in variants:
        t, ms = stateful_decode(st[k], prompts[:1], T)
        sp[k]["s1"].append((T - 1) / t)
        t, m1 = paged_decode(pg[k], prompts[:1], T)
        sp[k]["p1"].append((T - 1) / t)
        t, m8 = paged_decode(pg[k], prompts[:8], T)
        sp[k]["p8"].append(8 * (T - 1) / t)
        # batch independence: each stream alone vs in the batch of 8
        if r == 0:
            alone = [paged_decode(pg[k], [p], T)[1][0] for p in prompts]
            stal = [stateful_decode(st[k], [p], T)[1][0] for p in prompts]
            same[k] = {
                "paged_alone_eq_batched": sum(a == b for a, b in zip(alone, m8, strict=True)),
                "stateful_eq_paged": sum(a == b for a, b in zip(stal, alone, strict=True)),
            }
        print(r, k, {x: round(v[-1], 1) for x, v in sp[k].items()}, flush=True)
out = {k: {x: [round(a, 1) for a in v] for x, v in sp[k].items()} for k in variants}
print(json.dumps({"speeds": out, "same_of_8": same}))
