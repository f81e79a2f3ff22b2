"""``lakeshard bench prefill``: time to first token of a long prompt through real pipelines.

A user who pastes a file into the chat waits for the whole prompt to pass every stage before
the first token. The coordinator sends a prompt's pieces into the ring at once
(:func:`coordinator.batching.scheduler.prefill_chunks`), so while stage 0 runs the second piece, stage 1
runs the first. This bench measures that against the same pipeline taking the prompt as one
frame (which waits for each stage in turn), and against the whole model on one node's cores,
each run side by side: pieces, one frame, then the monolithic run, repeated ``--runs`` times.

Time to first token = request sent to the first token back at the coordinator; the monolithic
figure is the time of a 1-token generation (prefill plus choosing one token). Every node is a
separate agent process pinned to its own ``C`` cores, as in ``bench pipeline``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

from agent.common import aio
from agent.security.transport import PLAINTEXT
from coordinator.batching.scheduler import PREFILL_PIECES_PER_STAGE, GenRequest, Scheduler, prefill_chunks
from coordinator.bench.pipeline import IDLE_S, BenchError, Mono, _ints, _say, prepare, synthetic_ids
from coordinator.lab.local_cluster import LocalCluster
from coordinator.service.config import ServeConfig
from coordinator.service.coordinator import Coordinator


async def _measure(cfg: ServeConfig, prompt: list[int], runs: int, mono: Mono) -> dict[str, list[float]]:
    coord = Coordinator(cfg)
    await coord.async_start()
    out: dict[str, list[float]] = {"pieces": [], "one_frame": [], "mono": []}
    try:
        sched = coord.scheduler
        assert isinstance(sched, Scheduler), "prefill pieces are the per-stream scheduler's"
        loop = asyncio.get_running_loop()

        async def first_token(per_stage: int) -> float:
            sched.prefill_per_stage = per_stage
            t0 = loop.time()
            async for _ in sched.async_generate(GenRequest(prompt=tuple(prompt), max_tokens=1)):
                break
            dt = loop.time() - t0
            await asyncio.sleep(IDLE_S)  # the stages stop spinning before the next measurement
            return dt

        await first_token(PREFILL_PIECES_PER_STAGE)  # warm-up: first inferences allocate
        await first_token(0)
        for _ in range(runs):
            out["pieces"].append(await first_token(PREFILL_PIECES_PER_STAGE))
            out["one_frame"].append(await first_token(0))
            out["mono"].append(1.0 / await asyncio.to_thread(mono.run, 1))
        return out
    finally:
        await coord.async_stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    if min(_ints(args.stages)) < 2:
        raise BenchError("--stages: pieces only overlap on 2 stages or more")
    setup = prepare(args)
    model, c = setup.model, args.cores_per_node
    # what the prompt says does not change how long it takes: any ids within the vocabulary
    prompt = synthetic_ids(args.prompt_tokens, span=int(model.config().vocab_size) - 20)
    mono = Mono(setup.whole_dir, setup.node_cores[0], prompt)
    rows = []
    try:
        for term, s in enumerate(setup.stages, start=1):
            with LocalCluster(s, cores=setup.node_cores[:s], threads=c, device="CPU") as cluster:
                cfg = ServeConfig(
                    nodes=cluster.nodes,
                    model=model,
                    opts=setup.opts,
                    transport=PLAINTEXT,
                    api_port=0,
                    quiet=True,
                    term=term,
                    max_streams=1,
                    api=False,
                )
                res = aio.run(_measure(cfg, prompt, args.runs, mono))
            pieces = prefill_chunks(len(prompt), s)
            row = {
                "stages": s,
                "pieces": len(pieces),
                "ttft_ms": round(1000 * statistics.median(res["pieces"]), 1),
                "ttft_one_frame_ms": round(1000 * statistics.median(res["one_frame"]), 1),
                "mono_ttft_ms": round(1000 * statistics.median(res["mono"]), 1),
                # medians of the side-by-side pairs
                "speedup_vs_one_frame": round(
                    statistics.median(o / p for p, o in zip(res["pieces"], res["one_frame"], strict=True)), 3
                ),
                "ratio_to_mono": round(
                    statistics.median(p / m for p, m in zip(res["pieces"], res["mono"], strict=True)), 3
                ),
                "one_frame_ratio_to_mono": round(
                    statistics.median(o / m for o, m in zip(res["one_frame"], res["mono"], strict=True)), 3
                ),
            }
            rows.append(row)
            _say(
                f"{s} stages, {len(prompt)}-token prompt in {len(pieces)} pieces: first token "
                f"{row['ttft_ms']:.0f} ms (one frame {row['ttft_one_frame_ms']:.0f} ms, one node "
                f"{row['mono_ttft_ms']:.0f} ms); runs {[round(1000 * x) for x in res['pieces']]} / "
                f"{[round(1000 * x) for x in res['one_frame']]} / {[round(1000 * x) for x in res['mono']]}"
            )
    finally:
        mono.close()
    return {
        "suite": "prefill",
        "model": model.name,
        "weights": setup.weights,
        "random_weights": bool(args.random_weights),
        "cores_per_node": c,
        "prompt_tokens": len(prompt),
        "runs": args.runs,
        "rows": rows,
    }
