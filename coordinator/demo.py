"""``lakeshard demo`` (what ``make run`` runs): a local cluster of agent processes answers a chat."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from agent import aio
from agent.export.exporter import ExportOptions, export_model
from agent.models.registry import REGISTRY
from agent.models.store import ModelStore
from coordinator.chat_client import stream_chat
from coordinator.local_cluster import LocalCluster
from coordinator.serve import Coordinator, ServeConfig, plan_ranges


def run_demo(args: argparse.Namespace) -> int:
    model = ModelStore().resolve(args.model)
    spec = REGISTRY.get(model.name)
    opts = ExportOptions(weights=args.weights or (spec.default_weights if spec else "int4"), group_size=args.group_size)
    export_model(model, plan_ranges(model, args.nodes, None), opts)  # before the agents start
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per = max(1, ncpu // args.nodes)
    cores = [list(range(i * per, (i + 1) * per)) for i in range(args.nodes)] if ncpu >= args.nodes else None
    print(f"starting {args.nodes} agent processes" + (f", {per} core(s) each" if cores else ""), file=sys.stderr)
    with LocalCluster(args.nodes, cores=cores) as cluster:
        cfg = ServeConfig(nodes=cluster.nodes, model=model, opts=opts, api_port=0, quiet=True)
        return aio.run(_ask(cfg, args))


async def _ask(cfg: ServeConfig, args: argparse.Namespace) -> int:
    coord = Coordinator(cfg)
    try:
        await coord.async_start()
        assert coord.export is not None
        for i, man in enumerate(coord.export.manifests):
            layers = man["stage"]
            print(
                f"stage {i}: layers {layers['layer_start']}..{layers['layer_end'] - 1} on agent {cfg.nodes[i]}",
                file=sys.stderr,
            )
        print(f"coordinator API: {coord.api_url}/v1\n\n> {args.prompt}\n", file=sys.stderr)
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        n = 0

        def ask() -> None:
            nonlocal n
            for d in stream_chat(
                coord.api_url, [{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens, temperature=0.0
            ):
                n += 1
                sys.stdout.write(d)
                sys.stdout.flush()
            sys.stdout.write("\n")

        await loop.run_in_executor(None, ask)
        print(f"[{n} chunks in {time.monotonic() - t0:.1f}s through {len(cfg.nodes)} stages]", file=sys.stderr)
        return 0
    finally:
        await coord.async_stop()
