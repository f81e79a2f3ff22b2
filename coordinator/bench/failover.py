"""``lakeshard bench failover``: how long a generation pauses when a stage agent dies, and what it loses.

(``--kill coordinator``: the coordinator dies instead; see :mod:`coordinator.bench.takeover`.)

Each trial starts ``--nodes`` agent processes on loopback and a coordinator, runs a greedy
generation of ``--tokens`` tokens, and SIGKILLs a random stage's agent after a random token.
It measures the time from the kill to the next token reaching the caller, and compares the
text with an uninterrupted run: tokens lost or duplicated around the kill (must be 0).
Activations, KV cache and wire are f32 (``exact``), so the re-planned, differently split
pipeline must produce exactly the same tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from agent.common import aio
from agent.export.exporter import ExportOptions
from agent.models.store import LocalModel, ModelStore
from agent.security.transport import PLAINTEXT
from coordinator.batching.scheduler import GenRequest
from coordinator.bench.pipeline import BenchError
from coordinator.lab.local_cluster import LocalCluster
from coordinator.service.config import ServeConfig
from coordinator.service.coordinator import Coordinator

QUESTION = "Tell me a long story about a lighthouse keeper and a storm."


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def generate_with_kill(
    cfg: ServeConfig, cluster: LocalCluster, prompt: tuple[int, ...], tokens: int, kill: Sequence[int], at: int
) -> tuple[list[int], float | None, list[dict[str, object]]]:
    """Greedy-generate ``tokens`` tokens; after token ``at``, SIGKILL the agents ``kill``.

    Returns the tokens, the seconds from the kill to the next token, and the recoveries."""
    coord = Coordinator(cfg)
    await coord.async_start()
    try:
        assert coord.scheduler is not None
        out: list[int] = []
        t_kill, pause = 0.0, None
        async for tok in coord.scheduler.async_generate(GenRequest(prompt=prompt, max_tokens=tokens)):
            if t_kill and pause is None:
                pause = time.monotonic() - t_kill
            out.append(tok)
            if kill and len(out) == at:
                t_kill = time.monotonic()
                for i in kill:
                    cluster.kill(i)
        return out, pause, coord.recoveries
    finally:
        await coord.async_stop()


def compare(ref: list[int], out: list[int], at: int) -> tuple[int, int, bool]:
    """(tokens lost, tokens duplicated, identical) around position ``at``."""
    if out == ref:
        return 0, 0, True
    if out[:at] != ref[:at]:
        return 0, 0, False
    for k in range(1, 16):
        if out[at:] == ref[at + k : at + k + len(out) - at]:
            return k, 0, False
        if out[at + k :] == ref[at : at + len(out) - at - k]:
            return 0, k, False
    return 0, 0, False


def run(args: argparse.Namespace) -> dict[str, Any]:
    """``--kill stage`` (``--kill coordinator`` is :mod:`coordinator.bench.takeover`'s)."""
    if args.nodes < 2:
        raise BenchError("--nodes must be at least 2 (a failover needs a survivor)")
    model: LocalModel = ModelStore().resolve(args.model, quiet=bool(args.json))
    from agent.runtime.tokenizer import ChatTokenizer

    tok = ChatTokenizer(model.tokenizer_dir, model.dir / "config.json")
    prompt = tuple(tok.chat_ids([{"role": "user", "content": QUESTION}]))
    rng = random.Random(args.seed)
    term = 1000

    def cfg(nodes: list[str]) -> ServeConfig:
        nonlocal term
        term += 10
        return ServeConfig(
            nodes=nodes,
            model=model,
            opts=ExportOptions(weights=args.weights),
            transport=PLAINTEXT,
            exact=True,
            wire_dtype="f32",
            api=False,
            quiet=True,
            term=term,
            max_streams=2,
        )

    with LocalCluster(args.nodes) as c:
        ref, _, _ = aio.run(generate_with_kill(cfg(c.nodes), c, prompt, args.tokens, (), -1))
    _say(f"reference: {len(ref)} tokens on {args.nodes} stages")
    pauses: list[float] = []
    lost = dup = 0
    identical = True
    for trial in range(args.trials):
        stage, at = rng.randrange(args.nodes), rng.randrange(5, len(ref) - 5)
        with LocalCluster(args.nodes) as c:
            out, pause, _ = aio.run(generate_with_kill(cfg(c.nodes), c, prompt, args.tokens, (stage,), at))
        lo, du, same = compare(ref, out, at)
        lost, dup, identical = lost + lo, dup + du, identical and same
        if pause is None:
            raise BenchError(f"trial {trial}: the generation did not continue after the kill")
        pauses.append(pause)
        _say(
            f"trial {trial + 1}/{args.trials}: stage {stage} killed after token {at}: next token {pause:.2f}s later"
            f"{'' if same else f', DIFFERENT text (lost {lo}, duplicated {du})'}"
        )
    return {
        "trials": args.trials,
        "nodes": args.nodes,
        "model": model.name,
        "weights": args.weights,
        "tokens": args.tokens,
        "recovery_median_s": round(statistics.median(pauses), 3),
        "recovery_max_s": round(max(pauses), 3),
        "tokens_lost": lost,
        "tokens_duplicated": dup,
        "outputs_identical": identical,
        "recovery_s": [round(p, 3) for p in pauses],
    }
