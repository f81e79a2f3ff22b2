"""The coordinator's commands: ``export``, ``generate``, ``serve``, ``chat``, ``demo`` and ``bench``.

Added to ``lakeshard`` through the ``lakeshard.commands`` entry point (pyproject.toml): the
``agent`` package, which owns the command line, never imports this one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from agent.cli.args import (
    CliError,
    Commands,
    add_split_args,
    add_weights_args,
    count,
    cuts,
    nodes,
    port,
    positive_int,
    spec_k,
)


def add_commands(commands: Commands) -> None:
    from agent.common.ports import ListenError
    from agent.export.exporter import ExportError
    from agent.models.checkpoint import CheckpointError
    from agent.runtime.device import DeviceError
    from coordinator.bench.cli import add_bench
    from coordinator.planning.planner import PlanError
    from coordinator.ring.pipeline import PipelineError

    # (a port serve cannot listen on: one line, as the agent says it)
    commands.user_errors += [ExportError, CheckpointError, PlanError, DeviceError, PipelineError, ListenError]
    ex = commands.add("export", "export a model as pipeline-stage OpenVINO IRs", _export)
    ex.add_argument("model", help="a model name, or a path to a GGUF file / HF directory")
    add_split_args(ex, None)
    add_weights_args(ex)
    ex.add_argument("--no-beam-idx", action="store_true", help="omit the beam_idx Gather (for the A/B benchmark)")
    ex.add_argument("--genai", action="store_true", help="one whole-model IR loadable by OpenVINO GenAI")
    ex.add_argument("--out", type=Path, help="output directory (default: the export cache)")
    ex.add_argument("--force", action="store_true", help="re-export even if a matching export exists")
    ex.add_argument("--in-process", action="store_true", help="do not use a child process per stage")

    gen = commands.add("generate", "answer one chat prompt through an in-process chain of stages", _generate)
    gen.add_argument("model")
    add_split_args(gen, 2)
    add_weights_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--system", help="system message")
    gen.add_argument("--max-tokens", type=positive_int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="AUTO", help="AUTO (GPU if present, else CPU), CPU, GPU or NPU")
    gen.add_argument("--threads", type=positive_int, help="CPU inference threads")
    gen.add_argument("--stats", action="store_true", help="print speed figures to stderr")

    sv = commands.add("serve", "coordinate a pipeline over agents and serve the OpenAI-compatible API", _serve)
    sv.add_argument("--nodes", required=True, type=nodes, help="agents as host:port,host:port,... in stage order")
    sv.add_argument("--model", default="smollm2-135m")
    add_weights_args(sv)
    sv.add_argument("--split", type=cuts, help="first layer of each stage after the first (default: by cost)")
    sv.add_argument("--api-host", default="127.0.0.1")
    sv.add_argument("--api-port", type=port, default=8000)
    sv.add_argument("--api-key", help="required from clients (mandatory when --api-host is not loopback)")
    sv.add_argument(
        "--api-rate",
        type=count("requests per minute"),
        help="requests per minute per client, 0: unlimited (default: unlimited on loopback, else 60)",
    )
    sv.add_argument(
        "--api-concurrency",
        type=count("requests in flight"),
        help="requests in flight per client, 0: unlimited (default: unlimited on loopback, else 4)",
    )
    sv.add_argument("--data-host", default="127.0.0.1", help="address agents reach the coordinator on")
    sv.add_argument("--data-port", type=port, default=0)
    sv.add_argument("--streams", type=positive_int, default=4, help="streams in flight at once (stateful stages)")
    sv.add_argument(
        "--batch-streams", type=positive_int, default=64, help="streams a ring of paged stages batches at once"
    )
    sv.add_argument(
        "--batch-queue",
        type=int,
        default=64,
        help="requests that wait for a place in the batch before the API answers 503 with Retry-After",
    )
    sv.add_argument("--no-batching", action="store_true", help="one stream per step even where the stages are paged")
    sv.add_argument(
        "--no-prefix-cache", action="store_true", help="batching: never keep prompt heads for later requests"
    )
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
    sv.add_argument("--spec-k", type=spec_k, help="drafted tokens per round: a number, or auto (default)")
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

    ch = commands.add("chat", "chat in the terminal with a coordinator's API", _chat)
    ch.add_argument("--url", default="http://127.0.0.1:8000", help="the coordinator's API base URL")
    ch.add_argument("--api-key")
    ch.add_argument("--once", metavar="TEXT", help="ask one question, print the answer and exit")
    ch.add_argument("--max-tokens", type=positive_int, default=512)
    ch.add_argument("--temperature", type=float, default=0.0)

    dm = commands.add("demo", "start a local cluster of agent processes and answer one chat through it", _demo)
    dm.add_argument("--model", default="smollm2-135m")
    dm.add_argument("--nodes", type=positive_int, default=2, help="agent processes (stages)")
    add_weights_args(dm)
    dm.add_argument("--prompt", default="Explain in two sentences why splitting a language model across laptops helps.")
    dm.add_argument("--max-tokens", type=positive_int, default=200)

    add_bench(commands)


def _chat(args: argparse.Namespace) -> int:
    from coordinator.api.chat_client import run_chat

    return run_chat(args)


def _demo(args: argparse.Namespace) -> int:
    from coordinator.lab.demo import run_demo

    return run_demo(args)


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

    from agent.common.limits import MAX_CONCURRENCY, MAX_RATE
    from agent.models.store import ModelStore
    from coordinator.api.limits import resolve
    from coordinator.service.config import ServeConfig
    from coordinator.service.serve import run_coordinator

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
    from agent.common.ports import bind_error
    from coordinator.service.coordinator import api_port_error

    if args.api_port and (taken := bind_error(args.api_host, args.api_port)) is not None:
        raise api_port_error(args.api_host, args.api_port, taken)  # at once, not after the stages are ready
    from agent.security import transport
    from agent.security.credentials import NotMember
    from agent.security.errors import SecurityError

    try:  # node links: mutual TLS with this node's cluster credentials; plaintext only if told
        links = transport.choose(args.insecure)
    except NotMember as e:
        raise CliError(f"{e}; or --insecure for plaintext links (tests, benchmarks)") from None
    except SecurityError as e:
        raise CliError(str(e)) from None
    model = ModelStore().resolve(args.model)
    cfg = ServeConfig(
        nodes=args.nodes,
        model=model,
        opts=_export_opts(model, args),
        transport=links,
        split=args.split,
        api_host=args.api_host,
        api_port=args.api_port,
        api_key=args.api_key,
        api_limits=resolve(loopback, args.api_rate, args.api_concurrency),
        data_host=args.data_host,
        data_port=args.data_port,
        max_streams=args.streams,
        batching=not args.no_batching,
        prefix_cache=not args.no_prefix_cache,
        batch_streams=args.batch_streams,
        batch_queue=max(0, args.batch_queue),
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
