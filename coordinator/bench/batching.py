"""``lakeshard bench batching``: many users at once, our cluster against one laptop running stock
OpenVINO GenAI (issue 39's benchmark).

Four configurations, all alive for the whole run, and measured interleaved: for every number of
users U (and every run), each configuration in turn, the order rotated each time, so drift of
this machine hits them alike. Every node is an agent process pinned to its own ``C`` cores:

- ``genai``: GenAI's continuous batching (PagedAttention) on our whole-model ``--genai`` IR,
  in one process on the first node's cores (:mod:`coordinator.bench.genai_worker`);
- ``stage1``: our cluster, 1 stage on 1 node, paged attention;
- ``stage2``: 2 stages on 2 nodes, paged attention;
- ``stage2_per_stream``: 2 stages, stateful attention (one InferRequest per stream).

Our clusters are driven only through ``coord.scheduler.async_generate(GenRequest)``, like the
API. User i asks question i (:mod:`coordinator.bench.batching_prompts`, different lengths) and
gets ``--tokens`` greedy tokens (no stop token). Per configuration and U:

- ``tok_s``: all users' tokens / wall time from the first request to the last token;
- ``itl_p50_ms``, ``itl_p95_ms``: the gaps between a user's consecutive tokens, every user's
  gaps together;
- ``late_ttft_s``: U-1 users stream; once each has 8 tokens, user U arrives: its time to
  first token (then every request is cancelled).

Ratios to ``genai`` are taken per run (side by side), their median reported, with their min
and max over runs in ``spread``. ``outputs_identical``: every token list each prompt got (every
configuration, U and run) is the same; ``mismatches`` says where configurations differ (first
differing position per prompt) and ``batch_dependent`` which prompts changed with U within one
configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import statistics
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from agent.common import aio
from agent.export.exporter import ExportOptions, export_model
from agent.models.store import LocalModel, ModelStore
from agent.runtime.device import device_names
from agent.runtime.tokenizer import ChatTokenizer
from agent.security.transport import PLAINTEXT
from coordinator.batching.scheduler import GenRequest
from coordinator.bench.batching_prompts import user_prompts
from coordinator.bench.pipeline import (
    IDLE_S,
    BenchError,
    Pinned,
    _ints,
    _say,
    bench_devices,
    pin_to_spare,
    split_cores,
)
from coordinator.lab.local_cluster import LocalCluster
from coordinator.service.config import ServeConfig, plan_ranges
from coordinator.service.coordinator import Coordinator

CONFIGS = ("genai", "stage1", "stage2", "stage2_per_stream")
OURS = {"stage1": (1, "paged"), "stage2": (2, "paged"), "stage2_per_stream": (2, "stateful")}
LATE_AFTER = 8  # tokens each of the others has before the late user arrives
LATE_BUDGET = 256  # what the others ask for in the late phase (cancelled once it has its token)
WARMUP_TOKENS = 4

Streams = tuple[list[list[int]], list[list[float]]]  # each user's tokens, and when each arrived (s)


class Config(Protocol):
    async def batch(self, prompts: list[list[int]], tokens: int) -> Streams: ...
    async def late(self, prompts: list[list[int]], after: int, budget: int) -> float: ...
    async def close(self) -> None: ...


class GenAI:
    """The reference: GenAI's continuous batching in a process pinned to one node's cores."""

    def __init__(self, export_dir: Path, cores: list[int], device: str, warmup: list[int]) -> None:
        job = {"export_dir": str(export_dir), "threads": len(cores), "device": device, "warmup": warmup}
        self.worker = Pinned("coordinator.bench.genai_worker", job, cores, "GenAI continuous batching")
        self.props = self.worker.ready.get("props", {})

    async def batch(self, prompts: list[list[int]], tokens: int) -> Streams:
        res = await asyncio.to_thread(self.worker.ask, {"op": "batch", "prompts": prompts, "tokens": tokens})
        return res["tokens"], res["stamps"]

    async def late(self, prompts: list[list[int]], after: int, budget: int) -> float:
        msg = {"op": "late", "prompts": prompts, "after": after, "budget": budget}
        return float((await asyncio.to_thread(self.worker.ask, msg))["ttft"])

    async def close(self) -> None:
        await asyncio.to_thread(self.worker.close)


class Ours:
    """One of our clusters: agent processes on their cores, and an in-process coordinator."""

    def __init__(self, cluster: LocalCluster, coord: Coordinator) -> None:
        self.cluster, self.coord = cluster, coord

    @classmethod
    async def start(cls, stages: int, attention: str, term: int, setup: Setup) -> Ours:
        cores, device = setup.node_cores[:stages], ",".join(setup.devices)
        threads = len(cores[0])
        cluster = LocalCluster(stages, cores=cores, threads=threads, device=device, attention=attention)
        await asyncio.to_thread(cluster.start)
        try:
            cfg = ServeConfig(
                nodes=cluster.nodes,
                model=setup.model,
                opts=setup.opts,
                transport=PLAINTEXT,
                api_port=0,
                quiet=True,
                term=term,
                max_streams=setup.max_users,
                api=False,
            )
            coord = Coordinator(cfg)
            await coord.async_start()
        except BaseException:
            await asyncio.to_thread(cluster.stop)
            raise
        return cls(cluster, coord)

    def _generate(self, prompt: list[int], tokens: int) -> AsyncGenerator[int, None]:
        sched = self.coord.scheduler
        assert sched is not None
        return sched.async_generate(GenRequest(prompt=tuple(prompt), max_tokens=tokens))

    async def batch(self, prompts: list[list[int]], tokens: int) -> Streams:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(p: list[int]) -> tuple[list[int], list[float]]:
            toks: list[int] = []
            stamps: list[float] = []
            async for tok in self._generate(p, tokens):
                toks.append(tok)
                stamps.append(loop.time() - t0)
            return toks, stamps

        res = await asyncio.gather(*[one(p) for p in prompts])
        return [r[0] for r in res], [r[1] for r in res]

    async def late(self, prompts: list[list[int]], after: int, budget: int) -> float:
        loop = asyncio.get_running_loop()
        going = [asyncio.Event() for _ in prompts[:-1]]

        async def other(p: list[int], ev: asyncio.Event) -> None:
            n = 0
            try:
                async for _ in self._generate(p, budget):
                    n += 1
                    if n >= after:
                        ev.set()
            finally:
                ev.set()  # also when it failed: the failure is raised below

        tasks = [asyncio.create_task(other(p, ev)) for p, ev in zip(prompts, going, strict=False)]
        try:
            await asyncio.gather(*[ev.wait() for ev in going])
            for t in tasks:
                if t.done() and t.exception() is not None:
                    raise BenchError(f"a stream failed before the late user arrived: {t.exception()}")
            t0 = loop.time()
            async with contextlib.aclosing(self._generate(prompts[-1], 1)) as gen:
                async for _ in gen:
                    break
            return loop.time() - t0
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        try:
            await self.coord.async_stop()
        finally:
            await asyncio.to_thread(self.cluster.stop)


@dataclass
class Sample:
    tok_s: float
    itl_p50_ms: float
    itl_p95_ms: float
    late_ttft_s: float


def sample(streams: Streams, late_ttft: float) -> Sample:
    tokens, stamps = streams
    wall = max(s[-1] for s in stamps if s)
    gaps = [b - a for s in stamps for a, b in itertools.pairwise(s)]
    p50, p95 = (float(np.percentile(gaps, q)) * 1000 for q in (50, 95)) if gaps else (0.0, 0.0)
    return Sample(sum(map(len, tokens)) / wall, p50, p95, late_ttft)


@dataclass
class Record:
    samples: dict[tuple[str, int], list[Sample]] = field(default_factory=dict)
    seen: dict[str, dict[int, list[list[int]]]] = field(default_factory=dict)  # config -> prompt -> outputs

    def add(self, name: str, users: int, s: Sample, tokens: list[list[int]]) -> None:
        self.samples.setdefault((name, users), []).append(s)
        for i, toks in enumerate(tokens):
            self.seen.setdefault(name, {}).setdefault(i, []).append(list(toks))


async def _round(cfgs: dict[str, Config], prompts: list[list[int]], tokens: int, shift: int, rec: Record) -> None:
    """Every configuration once for these users, in an order rotated by ``shift``."""
    users, line = len(prompts), []
    for name in CONFIGS[shift % len(CONFIGS) :] + CONFIGS[: shift % len(CONFIGS)]:
        streams = await cfgs[name].batch(prompts, tokens)
        await asyncio.sleep(IDLE_S)  # the stages stop spinning: the next configuration gets the cores
        ttft = await cfgs[name].late(prompts, LATE_AFTER, max(LATE_BUDGET, tokens))
        await asyncio.sleep(IDLE_S)
        s = sample(streams, ttft)
        rec.add(name, users, s, streams[0])
        line.append(f"{name} {s.tok_s:.1f} tok/s (itl p50 {s.itl_p50_ms:.0f} ms, late ttft {s.late_ttft_s:.2f} s)")
    _say(f"  U={users}: " + "; ".join(line))


@dataclass(frozen=True)
class Setup:
    model: LocalModel
    weights: str
    opts: ExportOptions
    genai_dir: Path
    node_cores: list[list[int]]
    devices: list[str]
    prompts: list[list[int]]
    max_users: int


def _prepare(args: argparse.Namespace, users: list[int]) -> Setup:
    quiet = bool(args.json)
    devices = bench_devices(args)
    node_cores = split_cores(2, args.cores_per_node)
    model = ModelStore().resolve(args.model, quiet=quiet)
    opts = ExportOptions(weights=args.weights)
    genai = export_model(model, [(0, model.num_layers)], ExportOptions(weights=args.weights, genai=True), quiet=quiet)
    for s in (1, 2):
        export_model(model, plan_ranges(model, s, None), opts, quiet=quiet)
    prompts = user_prompts(ChatTokenizer(model.tokenizer_dir, model.dir / "config.json"), max(users))
    _say(f"prompt lengths {[len(p) for p in prompts]}; the nodes' cores {node_cores}")
    return Setup(model, args.weights, opts, genai.dir, node_cores, devices, prompts, max(users))


async def _start(setup: Setup) -> dict[str, Config]:
    """Every configuration, one after the other (started at once on a busy machine, an agent
    compiling its stage can miss the coordinator's pings)."""
    cfgs: dict[str, Config] = {}
    try:
        cfgs["genai"] = await asyncio.to_thread(
            GenAI, setup.genai_dir, setup.node_cores[0], setup.devices[0], setup.prompts[0]
        )
        _say("genai: loaded")
        for term, (name, (stages, attention)) in enumerate(OURS.items(), start=1):
            cfgs[name] = await Ours.start(stages, attention, term, setup)
            _say(f"{name}: {stages} stage(s), {attention} attention, serving")
        return cfgs
    except BaseException:
        await _close(cfgs)
        raise


async def _close(cfgs: dict[str, Config]) -> None:
    for cfg in cfgs.values():
        try:
            await cfg.close()
        except Exception as e:  # the others still stop
            _say(f"closing: {e}")


async def _measure(setup: Setup, args: argparse.Namespace, users: list[int]) -> tuple[Record, dict[str, Any]]:
    cfgs = await _start(setup)
    rec = Record()
    try:
        for name in CONFIGS:  # warm-up: first inferences (and the first batches of each size) allocate
            await cfgs[name].batch(setup.prompts, WARMUP_TOKENS)
        for r in range(args.runs):
            _say(f"run {r + 1}/{args.runs}")
            for k, u in enumerate(users):
                await _round(cfgs, setup.prompts[:u], args.tokens, r + k, rec)
        assert isinstance(cfgs["genai"], GenAI)
        return rec, cfgs["genai"].props
    finally:
        await _close(cfgs)


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _outputs(rec: Record) -> tuple[dict[str, Any], dict[str, list[list[int]]]]:
    """Whether every prompt got the same tokens everywhere, where not, and each configuration's
    tokens per prompt (the first answer each prompt got: alone or in the smallest batch)."""
    canon = {n: [outs[0] for _, outs in sorted(rec.seen[n].items())] for n in CONFIGS}
    batch_dependent = {
        n: sorted(i for i, outs in rec.seen[n].items() if any(o != outs[0] for o in outs)) for n in CONFIGS
    }
    pairs = [(a, "genai") for a in OURS] + [("stage2", "stage1"), ("stage2_per_stream", "stage1")]
    mismatches = {
        f"{a}_vs_{b}": [
            {"prompt": i, "first_diff": _first_diff(x, y)}
            for i, (x, y) in enumerate(zip(canon[a], canon[b], strict=True))
            if x != y
        ]
        for a, b in pairs
    }
    same = not any(batch_dependent.values()) and not any(mismatches.values())
    return {"outputs_identical": same, "mismatches": mismatches, "batch_dependent": batch_dependent}, canon


def _ratios(rec: Record, users: list[int]) -> dict[str, Any]:
    """Each of ours over ``genai``, per U: the median of the per-run ratios, and their min and max."""
    out: dict[str, Any] = {"spread": {}}
    for name in OURS:
        key = f"{name}_vs_genai"
        per_u = {
            str(u): [a.tok_s / g.tok_s for a, g in zip(rec.samples[(name, u)], rec.samples[("genai", u)], strict=True)]
            for u in users
        }
        out[key] = {u: round(statistics.median(v), 3) for u, v in per_u.items()}
        out["spread"][key] = {u: [round(min(v), 3), round(max(v), 3)] for u, v in per_u.items()}
    return out


def _rows(rec: Record, users: list[int]) -> list[dict[str, Any]]:
    rows = []
    for u in users:
        for name in CONFIGS:
            ss = rec.samples[(name, u)]
            rows.append(
                {
                    "config": name,
                    "users": u,
                    "tok_s": round(statistics.median(s.tok_s for s in ss), 2),
                    "itl_p50_ms": round(statistics.median(s.itl_p50_ms for s in ss), 1),
                    "itl_p95_ms": round(statistics.median(s.itl_p95_ms for s in ss), 1),
                    "late_ttft_s": round(statistics.median(s.late_ttft_s for s in ss), 3),
                    "tok_s_runs": [round(s.tok_s, 2) for s in ss],
                }
            )
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        users = sorted(set(_ints(args.users)))
    except ValueError:
        users = []
    if not users or min(users) < 1:
        raise BenchError(f"--users: one or more positive numbers, e.g. 1,2,4,8,16, not {args.users!r}")
    setup = _prepare(args, users)
    spare = pin_to_spare(setup.node_cores)
    _say(f"genai and stage1 on the first node's cores, stage2 on both; coordinator on {spare or 'any core'}")
    rec, props = aio.run(_measure(setup, args, users))
    same, canon = _outputs(rec)
    if args.outputs:
        Path(args.outputs).write_text(json.dumps(canon))
    result: dict[str, Any] = {
        "suite": "batching",
        "model": setup.model.name,
        "weights": setup.weights,
        "device": ",".join(setup.devices),
        "device_names": {d: device_names().get(d, d) for d in setup.devices},
        "cores_per_node": args.cores_per_node,
        "users": users,
        "tokens": args.tokens,
        "prompt_lengths": [len(p) for p in setup.prompts],
        "late_after": LATE_AFTER,
        "runs": args.runs,
        "genai_properties": props,
        "rows": _rows(rec, users),
    }
    ratios = _ratios(rec, users)
    spread = ratios.pop("spread")
    result.update(ratios)
    result["spread"] = spread
    result.update(same)
    return result
