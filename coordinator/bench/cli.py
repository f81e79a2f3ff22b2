"""``lakeshard bench SUITE``: every benchmark's arguments; each prints one JSON object on its last line."""

from __future__ import annotations

import argparse
import importlib
import json

from agent.cli.args import CliError, Commands, positive_int


def add_bench(commands: Commands) -> None:
    b = commands.add("bench", "benchmarks (JSON on the last line)", _bench)
    bsub = b.add_subparsers(dest="bench_cmd", required=True, metavar="SUITE")
    par = bsub.add_parser("parity", help="monolithic reference vs our runner, shards and chains")
    par.add_argument("--model", default="smollm2-135m")
    par.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"])
    par.add_argument("--runs", type=positive_int, default=5)
    par.add_argument("--tokens", type=positive_int, default=128)
    par.add_argument("--threads", type=positive_int, default=2)
    par.add_argument("--exact", action="store_true", help="f32 activations and KV cache for every variant")
    par.add_argument("--device", default="CPU", help="where every variant runs: CPU, GPU, GPU.1 or AUTO")
    pl = bsub.add_parser("pipeline", help="multi-process pipelines vs one machine (nodes pinned to their own cores)")
    pl.add_argument("--model", default="smollm2-135m")
    pl.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"])
    pl.add_argument("--stages", default="1,2", help="stage counts, e.g. 1,2,3")
    pl.add_argument("--streams", default="1,2", help="concurrent streams, e.g. 1,2,3")
    pl.add_argument("--cores-per-node", type=positive_int, default=1)
    pl.add_argument("--link-delay-ms", default="0", help="one-way delays per hop to measure, e.g. 0,100")
    pl.add_argument("--wan-mbps", type=float, default=100.0, help="line rate of the emulated WAN rows")
    pl.add_argument("--tokens", type=positive_int, default=64, help="tokens per stream per run")
    pl.add_argument("--wan-tokens", type=positive_int, default=16, help="tokens per stream per run over a WAN")
    pl.add_argument("--prompt-tokens", type=positive_int, default=32, help="prompt length with random weights")
    pl.add_argument("--runs", type=positive_int, default=3)
    pl.add_argument("--random-weights", action="store_true", help="the model's shapes with random weights")
    pl.add_argument(
        "--device",
        default="CPU",
        help="the nodes' device: CPU, GPU, or a list cycled over the nodes (GPU,CPU: a mixed cluster); "
        "the monolithic reference runs on the first",
    )
    pl.add_argument(
        "--ring-loop",
        choices=["on", "off", "both"],
        default="on",
        help="plain decoding with the last stage feeding stage 0 itself (on), through the coordinator (off)",
    )
    pl.add_argument("--rebalance", action="store_true", help="time the stages first and re-split by what they measured")
    pl.add_argument(
        "--spin-ms", default="50", help="the agents' --spin-ms, one cluster each, e.g. 50,0 (an A/B in one run)"
    )
    pl.add_argument(
        "--head-help",
        default="auto",
        help="the agents' --head-help (stage 0 computes part of the head for a lone stream): auto, on, off, "
        "or several, one cluster each (auto,off)",
    )
    pl.add_argument("--json", action="store_true")
    bt = bsub.add_parser("batching", help="many users at once: our paged stages vs GenAI's continuous batching")
    bt.add_argument("--model", default="qwen2.5-coder-0.5b")
    bt.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"], default="int4")
    bt.add_argument("--users", default="1,2,4,8,16", help="concurrent users, e.g. 1,2,4")
    bt.add_argument("--tokens", type=positive_int, default=128, help="greedy tokens per user")
    bt.add_argument("--runs", type=positive_int, default=2)
    bt.add_argument("--cores-per-node", type=positive_int, default=1)
    bt.add_argument("--device", default="CPU", help="every node's device (and GenAI's): CPU or GPU")
    bt.add_argument("--outputs", help="write each configuration's tokens per prompt to this JSON file")
    bt.add_argument("--json", action="store_true")
    pf = bsub.add_parser("prefill", help="time to first token of a long prompt: pieces vs one frame vs one node")
    pf.add_argument("--model", default="smollm2-135m")
    pf.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"])
    pf.add_argument("--stages", default="2,3", help="stage counts, e.g. 2,3")
    pf.add_argument("--cores-per-node", type=positive_int, default=1)
    pf.add_argument("--prompt-tokens", type=positive_int, default=512)
    pf.add_argument("--runs", type=positive_int, default=5)
    pf.add_argument("--random-weights", action="store_true", help="the model's shapes with random weights")
    pf.add_argument("--json", action="store_true")
    from coordinator.bench.security import add_args as add_security_args

    add_security_args(bsub)
    me = bsub.add_parser("memory", help="what each extra stream costs a stage agent in memory")
    me.add_argument("--model", default="smollm2-135m")
    me.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"])
    me.add_argument("--streams", type=positive_int, default=4)
    me.add_argument("--prompt-tokens", type=positive_int, default=1024)
    me.add_argument(
        "--attention",
        type=_attentions,
        default=["stateful", "paged"],
        help="the stage's attention, each measured in its own agent (default: stateful,paged)",
    )
    me.add_argument("--random-weights", action="store_true")
    me.add_argument("--json", action="store_true")
    fo = bsub.add_parser("failover", help="pause and lost text when a stage agent or the coordinator dies mid-answer")
    fo.add_argument(
        "--kill",
        choices=["stage", "coordinator"],
        default="stage",
        help="what dies: a stage agent (the coordinator re-plans) or the coordinator (a new one takes over)",
    )
    fo.add_argument("--model", default="smollm2-135m")
    fo.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"], default="int8")
    fo.add_argument("--nodes", type=positive_int, default=3)
    fo.add_argument("--trials", type=positive_int, default=10)
    fo.add_argument("--tokens", type=positive_int, default=200)
    fo.add_argument("--seed", type=int, help="fixes the random stages and steps")
    fo.add_argument("--json", action="store_true")
    fm = bsub.add_parser("formation", help="from cluster init with two joins to the first answer, cold and warm")
    fm.add_argument("--model", default="smollm2-135m")
    fm.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"], default="int8")
    fm.add_argument("--timeout", type=float, default=1800.0, help="seconds each formation may take")
    fm.add_argument("--json", action="store_true")
    th = bsub.add_parser("throttle", help="how fast a node gets out of its user's way (Xvfb input), and what it costs")
    th.add_argument("--model", default="smollm2-135m")
    th.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"], default="int8")
    th.add_argument("--nodes", type=positive_int, default=3)
    th.add_argument("--trials", type=positive_int, default=5)
    th.add_argument("--tokens", type=positive_int, default=160)
    th.add_argument("--seed", type=int, help="fixes when the user's input comes")
    th.add_argument("--log-dir", help="keep the agents' output here")
    th.add_argument("--json", action="store_true")
    el = bsub.add_parser("election", help="coordinator failover and discovery times (root: network namespaces)")
    el.add_argument("--nodes", type=positive_int, default=4)
    el.add_argument("--trials", type=positive_int, default=10)
    el.add_argument(
        "--formation",
        type=int,
        default=0,
        help="also time this many cold starts of a plaintext and of a secure (init/invite/join, mTLS) cluster",
    )
    el.add_argument("--json", action="store_true")
    sp = bsub.add_parser("spec", help="speculative vs plain decoding through a pipeline, with rollback costs")
    sp.add_argument("--target", default="smollm2-135m")
    sp.add_argument("--draft", default="lookup", help="a draft model with the target's tokenizer, or lookup")
    sp.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"])
    sp.add_argument("--draft-weights", choices=["fp32", "fp16", "int8", "int4"], default="int4")
    sp.add_argument("--k", default="auto,2,3,5,7", help="K values to measure: auto and/or numbers")
    sp.add_argument(
        "--depth",
        default="auto",
        help="verify frames in flight per stream to measure (1, 2 = draft ahead, auto), e.g. 1,2",
    )
    sp.add_argument(
        "--confidence",
        default="auto",
        help="confidence bar to stop drafting (K=auto only): auto (from costs), off, or 0..1; e.g. auto,off",
    )
    sp.add_argument("--device", default="CPU", help="the nodes' device: CPU, GPU, or a list cycled over them")
    sp.add_argument("--prompts", choices=["code", "chat"], default="code")
    sp.add_argument("--num-prompts", type=positive_int, default=4)
    sp.add_argument("--stages", type=positive_int, default=1)
    sp.add_argument("--streams", type=positive_int, default=1)
    sp.add_argument("--cores-per-node", type=positive_int, help="default: this machine's cores / stages")
    sp.add_argument(
        "--draft-threads",
        type=positive_int,
        help="the draft model's threads (default: the coordinator's own cores, else a node's count)",
    )
    sp.add_argument("--link-delay-ms", type=float, default=0.0)
    sp.add_argument(
        "--coordinator-on",
        choices=["apart", "first"],
        default="apart",
        help="the coordinator's machine: apart from the nodes (a network hop to stage 0), "
        "or the first stage's node (as an elected agent serving stage 0: that hop is local, its cores shared)",
    )
    sp.add_argument("--wan-mbps", type=float, default=100.0, help="line rate when --link-delay-ms is set")
    sp.add_argument("--tokens", type=positive_int, default=96, help="tokens per prompt")
    sp.add_argument("--runs", type=positive_int, default=3)
    sp.add_argument("--no-genai", action="store_true", help="skip the OpenVINO GenAI comparison")
    sp.add_argument("--json", action="store_true")
    par.add_argument("--json", action="store_true", help="print only the JSON result line on stdout")


def _attentions(text: str) -> list[str]:
    """``stateful,paged``: the attentions to measure, in order, each once."""
    out = [a.strip().lower() for a in text.split(",") if a.strip()]
    bad = [a for a in out if a not in ("stateful", "paged")]
    if not out or bad or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"give stateful, paged or both, each once, not {text!r}")
    return out


def _bench(args: argparse.Namespace) -> int:
    from coordinator.bench.pipeline import BenchError

    name = args.bench_cmd
    if name == "failover" and args.kill == "coordinator":
        name = "takeover"  # the coordinator dies: a new one takes over
    suite = importlib.import_module(f"coordinator.bench.{name}")
    try:
        result = suite.run(args)
    except BenchError as e:
        raise CliError(str(e)) from None
    print(json.dumps(result))
    return 0
