"""Probe: greedy decode of U streams on one stage, paged-batched vs stateful per stream.

``python -m coordinator.bench.paged_probe [--users 1,2,4,8] [--tokens 64] [--runs 2]``

Not a test and not a ``lakeshard bench`` suite (issue 39 builds that on the scheduler): a
first look at what batching in one infer call buys on one stage. Both paths run the same
1-stage IR on one CPU thread (``INFERENCE_NUM_THREADS=1``) with the same compile properties:

- stateful: one InferRequest per stream (today's stage), one token per stream in turn;
- paged: :class:`~agent.runtime.paged.PagedStage`, every stream's token in one infer call.

Each user has a different chat prompt; prefill is not timed. Aggregate tok/s = U x tokens
over the decode time. Configurations are interleaved per round; one JSON object is printed
on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from agent.runtime.paged import Entry, PagedStage
from agent.runtime.stage import Stage

TEXTS = [
    "What is the capital of France? Tell me about the city.",
    "Write a short Python function that checks whether a number is prime.",
    "List three tips for staying focused while working from home.",
    "Why is the sky blue?",
    "Explain photosynthesis to a ten year old in simple words.",
    "Translate 'good morning' into Spanish and French.",
    "Give me a haiku about autumn leaves.",
    "What are the planets of the solar system?",
]


def stateful_decode(stage: Stage, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    streams = [stage.open_stream() for _ in prompts]
    last = []
    for st, p in zip(streams, prompts, strict=True):
        out = stage.forward(st, np.asarray(p, dtype=np.int64)[None, :])
        assert out.token_ids is not None
        last.append(int(out.token_ids[-1]))
    made = [[t] for t in last]
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        for i, st in enumerate(streams):
            out = stage.forward(st, np.array([[made[i][-1]]], dtype=np.int64), validate=False)
            assert out.token_ids is not None
            made[i].append(int(out.token_ids[-1]))
    return time.perf_counter() - t0, made


def paged_decode(stage: PagedStage, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    ids = list(range(len(prompts)))
    for i in ids:
        stage.open_stream(i)
    res = stage.step([Entry(i, np.asarray(p, dtype=np.int64)) for i, p in zip(ids, prompts, strict=True)])
    made = []
    for i in ids:
        toks = res.out(i).token_ids
        assert toks is not None
        made.append([int(toks[-1])])
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        res = stage.step([Entry(i, np.array([made[i][-1]], dtype=np.int64)) for i in ids])
        assert res.token_ids is not None
        for i in ids:
            made[i].append(int(res.token_ids[i]))
    dt = time.perf_counter() - t0
    for i in ids:
        stage.close_stream(i)
    return dt, made


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="int8")
    ap.add_argument("--users", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--exact", action="store_true", help="f32 activations and KV cache, no dynamic quantization")
    args = ap.parse_args(argv)
    from agent.export.exporter import ExportOptions, export_model
    from agent.models.store import ModelStore
    from agent.runtime.tokenizer import ChatTokenizer

    model = ModelStore().resolve(args.model, quiet=True)
    stage_dir = Path(export_model(model, [(0, model.num_layers)], ExportOptions(weights=args.weights), quiet=True).dir)
    stage_dir = stage_dir / "stage_0"
    tok = ChatTokenizer(model.tokenizer_dir, model.dir / "config.json")
    users = [int(u) for u in args.users.split(",")]
    prompts = [
        list(map(int, tok.chat_ids([{"role": "user", "content": TEXTS[i % len(TEXTS)]}]))) for i in range(max(users))
    ]
    kw: dict[str, Any] = {"device": "CPU", "threads": args.threads, "exact": args.exact}
    stateful, paged = Stage(stage_dir, **kw), PagedStage(stage_dir, **kw)
    stateful_decode(stateful, prompts[:1], 4)  # warm-up: first inferences allocate
    paged_decode(paged, prompts[:1], 4)
    speeds: dict[str, dict[int, list[float]]] = {"stateful": {u: [] for u in users}, "paged": {u: [] for u in users}}
    identical = True
    for _ in range(args.runs):
        for u in users:
            t_s, made_s = stateful_decode(stateful, prompts[:u], args.tokens)
            t_p, made_p = paged_decode(paged, prompts[:u], args.tokens)
            speeds["stateful"][u].append(u * (args.tokens - 1) / t_s)
            speeds["paged"][u].append(u * (args.tokens - 1) / t_p)
            identical = identical and made_s == made_p
    print(
        f"{args.model} {args.weights}, 1 stage, {args.threads} thread(s), {args.tokens} tokens a user, "
        f"kv {paged.kv_precision}, runs {args.runs}"
    )
    print("users  stateful tok/s          paged tok/s             paged/stateful")
    rows = []
    for u in users:
        s, p = statistics.median(speeds["stateful"][u]), statistics.median(speeds["paged"][u])
        fmt = " ".join(f"{x:6.1f}" for x in speeds["stateful"][u]), " ".join(f"{x:6.1f}" for x in speeds["paged"][u])
        print(f"{u:5d}  {fmt[0]:22s}  {fmt[1]:22s}  {p / s:5.2f}")
        rows += [
            {"config": "stateful", "users": u, "tok_s": round(s, 2), "runs": speeds["stateful"][u]},
            {"config": "paged", "users": u, "tok_s": round(p, 2), "runs": speeds["paged"][u]},
        ]
    result = {"rows": rows, "outputs_identical": identical, "kv_precision": paged.kv_precision}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
