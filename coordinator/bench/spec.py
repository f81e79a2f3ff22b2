"""``lakeshard bench spec``: speculative decoding against plain decoding, in the same run.

The target is served by agent processes pinned to their own cores (``--stages`` of them);
the coordinator, with the draft model (or prompt lookup), runs in this process. One
coordinator serves every configuration: plain (K=0), each fixed K and ``auto`` (the K
policy), interleaved run by run in rotated order, so machine drift hits them alike.
Throughput = generated tokens / wall time over the prompt set (prefill included).

It also times the two ways to drop rejected tokens from a stateful stage: the mask rollback
we use, and the physical trim (``query_state``/``set_state``) it replaces, against one
decode step. On one node it runs OpenVINO GenAI's own speculative pipeline too where it can.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from agent.common import aio
from agent.export.exporter import ExportOptions, export_model
from agent.models.registry import REGISTRY
from agent.models.store import LocalModel, ModelStore
from agent.runtime.device import device_names
from agent.runtime.device_profile import compile_properties
from agent.security.transport import PLAINTEXT
from coordinator.batching.scheduler import GenRequest
from coordinator.bench.pipeline import BenchError, bench_devices
from coordinator.bench.spec_prompts import PROMPTS
from coordinator.lab.local_cluster import LocalCluster
from coordinator.service.config import ServeConfig
from coordinator.service.coordinator import Coordinator


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_ks(v: str) -> list[int | None]:
    out: list[int | None] = []
    for x in v.split(","):
        x = x.strip()
        if not x:
            continue
        if x == "auto":
            out.append(None)
        elif x.isdigit() and 1 <= int(x) <= 32:
            out.append(int(x))
        else:
            raise BenchError(f"--k takes auto or numbers 1..32, got {x!r}")
    if not out:
        raise BenchError("--k is empty")
    return out


def parse_depths(v: str) -> list[int | None]:
    out: list[int | None] = []
    for x in (x.strip() for x in v.split(",")):
        if x not in ("auto", "1", "2", "3", "4"):
            raise BenchError(f"--depth takes auto or 1..4 (verify frames in flight), not {x!r}")
        out.append(None if x == "auto" else int(x))
    return out


def parse_confidences(v: str) -> list[float | None]:
    out: list[float | None] = []
    for x in (x.strip() for x in v.split(",")):
        if x == "auto":
            out.append(None)
            continue
        try:
            c = 0.0 if x == "off" else float(x)
        except ValueError:
            c = -1.0
        if not 0.0 <= c <= 1.0:
            raise BenchError(f"--confidence takes auto, off or a probability 0..1, not {x!r}")
        out.append(c)
    return out


# (K, verify frames in flight, the draft's confidence bar); None = chosen at run time
Config = tuple[int | None, int | None, float | None]


def _label(k: int | None, depth: int | None = None, conf: float | None = None) -> str:
    return (
        ("auto" if k is None else str(k))
        + ("" if depth is None else f"@{depth}")
        + ("" if conf is None else f"/c{conf:g}")
    )


def rollback_costs(
    stage_dir: Path, prompt: list[int], threads: int, k: int = 3, reps: int = 15, device: str = "CPU"
) -> dict[str, float]:
    """Median ms of a mask rollback, a physical trim and one decode step on a real stage."""
    from agent.runtime.stage import Stage

    stage = Stage(stage_dir, device=device, threads=threads)
    mask_ms, trim_ms, step_ms = [], [], []
    streams = [stage.open_stream(), stage.open_stream()]
    for st in streams:
        st.reset()
        stage.forward(st, np.asarray(prompt, dtype=np.int64)[None, :])
    drafts = np.asarray([prompt[-1]] * (k + 1), dtype=np.int64)[None, :]
    one = np.asarray([[prompt[-1]]], dtype=np.int64)
    for _ in range(reps):
        masked, trimmed = streams
        stage.forward(masked, drafts)
        t0 = time.perf_counter()
        masked.rollback(k)
        mask_ms.append((time.perf_counter() - t0) * 1000)
        stage.forward(trimmed, drafts)
        t0 = time.perf_counter()
        trimmed.trim(k)
        trim_ms.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        stage.forward(trimmed, one)
        step_ms.append((time.perf_counter() - t0) * 1000)
        stage.forward(masked, one)
    m, t, s = (statistics.median(x) for x in (mask_ms, trim_ms, step_ms))
    return {
        "rollback_mask_ms": round(m, 4),
        "rollback_trim_ms": round(t, 3),
        "decode_step_ms": round(s, 3),
        "rollback_mask_pct_step": round(100 * m / s, 4),
        "rollback_trim_pct_step": round(100 * t / s, 1),
    }


def genai_spec(
    target: LocalModel,
    draft: LocalModel | None,
    weights: str,
    draft_weights: str,
    k: int,
    prompts: list[list[int]],
    tokens: int,
    threads: int,
    device: str = "CPU",
) -> dict[str, Any]:
    """OpenVINO GenAI on one node, on the stage's device: plain LLMPipeline and its speculative
    pipeline (the draft on the same device)."""
    out: dict[str, Any] = {"genai_device": device, "genai_tok_s": None, "genai_spec_tok_s": None}
    try:
        import openvino as ov
        import openvino_genai as ovg
    except ImportError as e:
        out["genai_error"] = f"openvino_genai is not installed: {e}"
        return out
    tdir = export_model(target, [(0, target.num_layers)], ExportOptions(weights=weights, genai=True), quiet=True).dir
    # what our stages compile with on that device (its precision, its KV cache precision)
    props: dict[str, Any] = compile_properties(device, threads=threads if device == "CPU" else None)

    def timed(pipe: Any, extra: dict[str, Any]) -> float:
        cfg = pipe.get_generation_config()
        cfg.max_new_tokens, cfg.min_new_tokens, cfg.ignore_eos, cfg.do_sample = tokens, tokens, True, False
        for key, v in extra.items():
            setattr(cfg, key, v)
        n, t0 = 0, time.perf_counter()
        for p in prompts:
            arr = np.asarray(p, dtype=np.int64)[None, :]
            res = pipe.generate(ovg.TokenizedInputs(ov.Tensor(arr), ov.Tensor(np.ones_like(arr))), cfg)
            n += len(res.tokens[0])
        return n / (time.perf_counter() - t0)

    plain = ovg.LLMPipeline(str(tdir), device, ATTENTION_BACKEND="SDPA", **props)
    out["genai_tok_s"] = round(timed(plain, {}), 2)
    del plain
    try:
        if draft is None:
            pipe = ovg.LLMPipeline(str(tdir), device, prompt_lookup=True, **props)
            extra: dict[str, Any] = {"num_assistant_tokens": k, "max_ngram_size": 3}
        else:
            ddir = export_model(
                draft, [(0, draft.num_layers)], ExportOptions(weights=draft_weights, genai=True), quiet=True
            ).dir
            pipe = ovg.LLMPipeline(str(tdir), device, draft_model=ovg.draft_model(str(ddir), device, **props), **props)
            extra = {"num_assistant_tokens": k}
        out["genai_spec_tok_s"] = round(timed(pipe, extra), 2)
    except Exception as e:  # GenAI's speculative path rewrites the graph for PagedAttention
        out["genai_spec_error"] = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
    return out


# a run's counts, from the speculator's counters: declined = requests the draft's prefill would
# not repay; ring = K=auto's plain tokens round the ring
_COUNTED = {
    "rounds": "rounds",
    "proposed": "proposed",
    "accepted": "accepted",
    "declined": "declined",
    "ring": "ring_tokens",
}


async def _measure(
    cfg: ServeConfig, prompts: list[list[int]], configs: list[Config], tokens: int, runs: int
) -> dict[str, dict[str, Any]]:
    coord = Coordinator(cfg)
    await coord.async_start()
    try:
        sched = coord.scheduler
        assert sched is not None and sched.speculator is not None
        spec = sched.speculator

        async def one(p: list[int], c: Config, n: int) -> list[int]:
            req = GenRequest(tuple(p), max_tokens=n, spec_k=c[0], spec_depth=c[1], spec_min_conf=c[2])
            return [t async for t in sched.async_generate(req)]

        configs = [(0, None, None), *configs]
        for c in configs:  # warm-up (first inferences allocate; the K policy gets first figures)
            await asyncio.gather(*[one(p, c, 8) for p in prompts[:2]])
        res: dict[str, dict[str, Any]] = {
            _label(*c): {"speeds": [], **dict.fromkeys(_COUNTED, 0), "outputs": None} for c in configs
        }
        loop = asyncio.get_running_loop()
        for r in range(runs):
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for c in order:
                c0 = {key: getattr(spec.counters, name) for key, name in _COUNTED.items()}
                t0 = loop.time()
                outs = await asyncio.gather(*[one(p, c, tokens) for p in prompts])
                dt = loop.time() - t0
                row = res[_label(*c)]
                row["speeds"].append(sum(len(o) for o in outs) / dt)
                for key, name in _COUNTED.items():
                    row[key] += getattr(spec.counters, name) - c0[key]
                row["outputs"] = row["outputs"] or outs
            _say(
                f"run {r + 1}/{runs}: "
                + ", ".join(f"K={name} {v['speeds'][-1]:.2f}" for name, v in res.items())
                + " tok/s"
            )
        learned = spec.stats.costs()
        if learned is not None:  # what the K policy learned, for the report
            res["policy"] = {
                "acceptance": round(learned.acceptance, 3),
                "draft_ms": round(1000 * learned.draft_s, 2),
                "step_ms": round(1000 * learned.step_s, 2),
                "extra_ms": round(1000 * learned.extra_s, 2),
            }
            if learned.plain_s is not None:  # a plain token round the ring (K=auto's plain stretches)
                res["policy"]["ring_ms"] = round(1000 * learned.plain_s, 2)
        # per prompt token: the target's prefill alone and beside the draft's, and the draft's own
        per_tok = {
            "target_prefill_ms_tok": spec.stats.target_prefill_s[False],
            "target_prefill_beside_draft_ms_tok": spec.stats.target_prefill_s[True],
            "draft_prefill_ms_tok": spec.stats.prefill_s,
        }
        for key, v in per_tok.items():
            if v is not None:
                res.setdefault("policy", {})[key] = round(1000 * v, 3)
        return res
    finally:
        await coord.async_stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    ks = parse_ks(args.k)
    parse_depths(args.depth)  # a bad --depth or --confidence fails before any export
    parse_confidences(args.confidence)
    device = ",".join(bench_devices(args))  # one kind for every node, or GPU,CPU (cycled)
    quiet = bool(args.json)
    store = ModelStore()
    target = store.resolve(args.target, quiet=quiet)
    spec = REGISTRY.get(target.name)
    weights = args.weights or (spec.default_weights if spec else "int4")
    draft = None if args.draft == "lookup" else store.resolve(args.draft.removesuffix("+lookup"), quiet=quiet)
    n, s = args.stages, args.streams
    avail = sorted(os.sched_getaffinity(0))
    c = args.cores_per_node or max(1, len(avail) // n)
    if n * c > len(avail):
        raise BenchError(f"{n} nodes x {c} cores need {n * c} cores; this machine has {len(avail)}")
    node_cores = [avail[i * c : (i + 1) * c] for i in range(n)]
    spare = avail[n * c :]
    draft_threads = args.draft_threads or (len(spare) if spare else c)

    from agent.runtime.tokenizer import ChatTokenizer
    from coordinator.service.config import plan_ranges

    tok = ChatTokenizer(target.tokenizer_dir, target.dir / "config.json")
    prompts = [tok.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS[args.prompts][: args.num_prompts]]
    opts = ExportOptions(weights=weights)
    whole = export_model(target, [(0, target.num_layers)], opts, quiet=quiet)
    export_model(target, plan_ranges(target, n, None), opts, quiet=quiet)

    result: dict[str, Any] = {
        "suite": "spec",
        "device": device,
        "device_names": {d: device_names().get(d, d) for d in bench_devices(args)},
        "target": target.name,
        "draft": args.draft,
        "prompts": args.prompts,
        "weights": weights,
        "draft_weights": args.draft_weights,
        "draft_threads": draft_threads,
        "stages": n,
        "streams": s,
        "cores_per_node": c,
        "link_delay_ms": args.link_delay_ms,
        "coordinator_on": args.coordinator_on,
        "tokens": args.tokens,
        "repeats": args.runs,
    }
    _say("timing rollback: mask vs physical trim")
    os.sched_setaffinity(0, node_cores[0])
    result.update(rollback_costs(whole.stage_dirs()[0], prompts[0], threads=c, device=device.split(",")[0]))
    os.sched_setaffinity(0, avail)

    with LocalCluster(n, cores=node_cores, threads=c, device=device) as cluster:
        home = args.coordinator_on == "first"
        if home:  # the coordinator shares the first stage's machine: its cores (and any spare ones)
            os.sched_setaffinity(0, node_cores[0] + spare)
        elif spare:  # the coordinator (and its draft) get cores of their own where there are any
            os.sched_setaffinity(0, spare)
        cfg = ServeConfig(
            nodes=cluster.nodes,
            model=target,
            opts=opts,
            transport=PLAINTEXT,
            quiet=True,
            api=False,
            max_streams=s,
            link_delay_ms=args.link_delay_ms,
            link_mbps=args.wan_mbps if args.link_delay_ms > 0 else 0.0,
            draft=args.draft,
            draft_weights=args.draft_weights,
            draft_threads=draft_threads,
            home=cluster.nodes[0] if home else None,
        )
        depths = parse_depths(args.depth)
        confs = parse_confidences(args.confidence)
        # a fixed K drafts all K tokens: the confidence bar applies to K=auto only
        configs: list[Config] = [(k, d, m) for d in depths for k in ks for m in (confs if k is None else [None])]
        res = aio.run(_measure(cfg, prompts, configs, args.tokens, args.runs))
    os.sched_setaffinity(0, avail)

    policy = res.pop("policy", None)
    plain = statistics.median(res[_label(0)]["speeds"])
    runs_out = []
    for k, d, m in configs:
        row = res[_label(k, d, m)]
        tps = statistics.median(row["speeds"])
        runs_out.append(
            {
                "k": _label(k),
                "depth": d or "auto",
                "min_conf": "auto" if m is None else m,
                "spec_tok_s": round(tps, 2),
                "speedup": round(tps / plain, 3),
                "acceptance": round(row["accepted"] / row["proposed"], 3) if row["proposed"] else 0.0,
                "mean_k": round(row["proposed"] / row["rounds"], 2) if row["rounds"] else 0.0,
                "tokens_identical": row["outputs"] == res["0"]["outputs"],
                "requests_without_draft": row["declined"],
                "ring_tokens": row["ring"],
            }
        )
    best = max(runs_out, key=lambda r: r["spec_tok_s"])
    result.update({"plain_tok_s": round(plain, 2), **best, "runs": runs_out, "policy_costs": policy})
    if n == 1 and args.link_delay_ms == 0 and not args.no_genai:
        fixed = [k for k in ks if k is not None]
        gk = int(best["k"]) if best["k"] != "auto" else (fixed[0] if fixed else 3)
        gdev = device.split(",")[0]
        _say(f"OpenVINO GenAI on the same {'cores' if gdev == 'CPU' else 'device'}, K={gk}")
        os.sched_setaffinity(0, node_cores[0])
        result.update(genai_spec(target, draft, weights, args.draft_weights, gk, prompts, args.tokens, c, gdev))
        os.sched_setaffinity(0, avail)
    return result
