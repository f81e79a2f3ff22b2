"""``lakeshard bench parity``: the monolithic reference against our runner, shards and chains.

All variants are compiled in one process on the same cores and run interleaved (one run of
each per round, the order rotated every round), so drift of the machine hits every variant
alike. Decode speed is
measured the same way for every variant: one over the median time of a decode step (the
steps after the first token; GenAI reports the same per-step durations), so a step delayed
by another tenant of the machine does not decide the figure. The result is the median over
runs.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from agent.export.exporter import ExportOptions, export_model
from agent.models.registry import REGISTRY
from agent.models.store import ModelStore
from agent.runtime.chain import Chain
from agent.runtime.device import choose_device, core, device_names
from agent.runtime.device_profile import compile_properties
from agent.runtime.tokenizer import ChatTokenizer
from coordinator.planning.planner import balanced_split, model_costs

log = logging.getLogger(__name__)
PRECISION = "INFERENCE_PRECISION_HINT"

PROMPT = (
    "Write a Python function that parses a CSV file of sales records (date, region, amount), "
    "and returns the total amount per region sorted from largest to smallest. Explain each step."
)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _genai_runner(
    export_dir: Any, device: str, props: dict[str, Any], ids: list[int], tokens: int
) -> Callable[[], Any]:
    import openvino as ov
    import openvino_genai as ovg

    # The stateful SDPA backend: the continuous-batching (PagedAttention) backend re-writes the
    # graph for optimum-style masks and does not accept this IR.
    pipe = ovg.LLMPipeline(str(export_dir), device, ATTENTION_BACKEND="SDPA", **props)
    cfg = pipe.get_generation_config()
    cfg.max_new_tokens = tokens
    cfg.min_new_tokens = tokens
    cfg.ignore_eos = True
    cfg.do_sample = False
    arr = np.asarray(ids, dtype=np.int64)[None, :]
    inputs = ovg.TokenizedInputs(ov.Tensor(arr), ov.Tensor(np.ones_like(arr)))

    def run() -> tuple[list[int], float]:
        res = pipe.generate(inputs, cfg)
        steps_us = list(res.perf_metrics.raw_metrics.m_durations)  # decode steps after the first token
        return [int(t) for t in res.tokens[0]], 1e6 / float(np.median(steps_us))

    return run


def _chain_runner(chain: Chain, ids: list[int], tokens: int) -> Callable[[], Any]:
    streams = chain.open_streams()

    def run() -> tuple[list[int], float]:
        g = chain.generate(ids, max_tokens=tokens, streams=streams)
        return g.tokens, g.median_tok_s

    return run


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = choose_device(getattr(args, "device", None) or "CPU")  # fail fast, before any export
    store = ModelStore()
    model = store.resolve(args.model, quiet=args.json)
    spec = REGISTRY.get(model.name)
    weights = args.weights or (spec.default_weights if spec else "int4")
    threads = args.threads
    quiet = bool(args.json)
    cfg = model.config()
    whole = [(0, model.num_layers)]
    two = balanced_split(model_costs(cfg), 2)
    exports = {
        "genai": export_model(model, whole, ExportOptions(weights=weights, genai=True), quiet=quiet),
        "shard1_beam": export_model(model, whole, ExportOptions(weights=weights), quiet=quiet),
        "shard1_nobeam": export_model(model, whole, ExportOptions(weights=weights, beam_idx=False), quiet=quiet),
        "chain2": export_model(model, two, ExportOptions(weights=weights), quiet=quiet),
        "chain2_nobeam": export_model(model, two, ExportOptions(weights=weights, beam_idx=False), quiet=quiet),
    }
    tok = ChatTokenizer(exports["chain2"].dir / "tokenizer")
    ids = tok.chat_ids([{"role": "user", "content": PROMPT}])
    exact = bool(args.exact)
    props = compile_properties(device, threads=threads, exact=exact)
    _say(f"device {device} ({device_names().get(device, device)}): {props}")
    runners: dict[str, Callable[[], Any]] = {
        "genai": _genai_runner(exports["genai"].dir, device, props, ids, args.tokens),
    }
    variants = ("shard1_beam", "shard1_nobeam", "chain2", "chain2_nobeam")
    for name, key in (("mono", "genai"), *((v, None) for v in variants)):
        chain = Chain.load(exports[key or name].dir, device=device, threads=threads, exact=exact)
        runners[name] = _chain_runner(chain, ids, args.tokens)

    for fn in runners.values():  # warm-up (first-inference allocations)
        fn()
    speeds: dict[str, list[float]] = {k: [] for k in runners}
    outputs: dict[str, list[int]] = {}
    names = list(runners)
    for r in range(args.runs):
        # rotate the order every round: no variant always runs first, or right after another
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = runners[name]
            toks, tps = fn()
            speeds[name].append(tps)
            outputs.setdefault(name, toks)
            if toks != outputs[name]:
                log.warning("%s gave different tokens on run %d", name, r)
        _say(f"round {r + 1}/{args.runs}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in speeds.items()))
    med = {k: statistics.median(v) for k, v in speeds.items()}
    ref = outputs["genai"][: args.tokens]
    result: dict[str, Any] = {
        "suite": "parity",
        "model": model.name,
        "weights": weights,
        "device": device,
        "device_name": device_names().get(device, device),
        "threads": threads if device == "CPU" else None,
        "precision": str(props.get("INFERENCE_PRECISION_HINT") or core().get_property(device, PRECISION)),
        "kv_precision": str(props.get("KV_CACHE_PRECISION")),
        "tokens": args.tokens,
        "runs": args.runs,
        "split2": two,
        "genai_tok_s": round(med["genai"], 2),
        "mono_tok_s": round(med["mono"], 2),
        "shard1_beam_tok_s": round(med["shard1_beam"], 2),
        "shard1_nobeam_tok_s": round(med["shard1_nobeam"], 2),
        "chain2_tok_s": round(med["chain2"], 2),
        "chain2_nobeam_tok_s": round(med["chain2_nobeam"], 2),
    }
    for k in ("mono", "shard1_beam", "shard1_nobeam", "chain2", "chain2_nobeam"):
        result[f"ratio_{k}"] = round(med[k] / med["genai"], 4)
    result["beam_idx_speedup"] = round(med["shard1_beam"] / med["shard1_nobeam"], 4)
    result["beam_idx_speedup_chain2"] = round(med["chain2"] / med["chain2_nobeam"], 4)
    result["tokens_identical"] = all(o[: args.tokens] == ref for o in outputs.values())
    if not result["tokens_identical"]:
        result["first_divergence"] = {
            k: next((i for i, (a, b) in enumerate(zip(o, ref, strict=False)) if a != b), None)
            for k, o in outputs.items()
        }
    return result
