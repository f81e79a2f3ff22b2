"""``lakeshard bench throttle``: how fast a laptop gets out of its user's way, and what that costs.

A local cluster of ``--nodes`` elected agents serves the model; one stage node (not the
coordinator's) has a display of its own: a real X server (Xvfb), its user's input coming from
``xdotool``. Each trial streams a greedy answer of ``--tokens`` tokens through the API, and
after a random token the "user" moves the mouse on that node's display. Measured:

* stop: from the input to that node's last compute step (the stage's own clock);
* resume: from the input until tokens flow again (the first token after the answer's longest
  stall, the new pipeline's), the user of the chat seeing only that pause;
* tokens lost or duplicated, and whether the text equals an undisturbed run's (f32 activations,
  so a different split gives the same tokens).

Between trials the node is left alone for its idle time (a short ``idle_minutes`` here), which
brings it back and the coordinator re-plans it in.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from coordinator.bench.pipeline import BenchError
from coordinator.lab.local_cluster import LocalCluster

PROMPT = "Tell me a long story about a lighthouse keeper and a storm."
IDLE_MINUTES = 0.05  # the node re-joins after 3 s without input
STOP_READ_S = 1.5  # when the stopped node's last step is read (well before it may re-join)
CONFIG = f"throttle:\n  idle_minutes: {IDLE_MINUTES}\n  min_dwell_s: 0.5\n  cpu_high_pct: off\n  gpu_high_pct: off\n"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as r:
        d: dict[str, Any] = json.loads(r.read())
        return d


def _wait(what: str, fn: Any, timeout: float, step: float = 0.1) -> Any:
    end = time.monotonic() + timeout
    while True:
        try:
            v = fn()
        except OSError:
            v = None
        if v:
            return v
        if time.monotonic() > end:
            raise BenchError(f"timed out waiting for {what}")
        time.sleep(step)


def stream(api: str, prompt: str, tokens: int, out: list[tuple[float, str]], stats: dict[str, Any]) -> None:
    """A streamed greedy answer: its pieces with their arrival times, and the final figures."""
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": tokens, "temperature": 0}
    req = urllib.request.Request(
        f"{api}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=900) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            msg = json.loads(line[6:])
            for ch in msg.get("choices", []):
                if ch["delta"].get("content"):
                    out.append((time.monotonic(), ch["delta"]["content"]))
            stats.update(msg.get("lakeshard") or {})


def resume_after(arrivals: list[float], t0: float) -> float | None:
    """Seconds from ``t0`` to the first arrival after the longest stall that follows it (pure)."""
    after = [t for t in arrivals if t >= t0]
    if not after:
        return None
    points = [t0, *after]
    gaps = [(b - a, b) for a, b in itertools.pairwise(points)]
    return max(gaps)[1] - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    missing = [t for t in ("Xvfb", "xdotool") if shutil.which(t) is None]
    if missing:
        raise BenchError(f"bench throttle needs {' and '.join(missing)} (Debian: apt-get install xvfb xdotool libxss1)")
    if args.nodes < 2:
        raise BenchError("--nodes: at least 2 (one to pause, one to carry on)")
    rng = random.Random(args.seed)
    from coordinator.lab.xdisplay import touch, xvfb

    with xvfb() as xenv:
        victim = args.nodes - 1
        envs: list[dict[str, str]] = [{} for _ in range(args.nodes)]
        envs[victim] = {"DISPLAY": xenv["DISPLAY"]}
        elect = ["--serve-model", args.model, "--serve-weights", args.weights, "--serve-exact"]
        _say(f"bench throttle: {args.nodes} agents serving {args.model}; node {victim} has a display and a user")
        log_dir = Path(args.log_dir) if args.log_dir else None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        # the node with a user serves a stage but never coordinates (its pauses would be elections)
        # and the plan spans every node (left to itself, the planner may put a small model on fewer,
        # and the wait for "every node in the plan" could only time out)
        base = CONFIG + f"serve:\n  min_nodes: {args.nodes}\n"
        configs = [base] * args.nodes
        configs[victim] = base + "election:\n  min_coordinator_memory_gb: 4096\n"
        cluster = LocalCluster(
            args.nodes, elect=elect, throttle=True, config=configs, agent_envs=envs, log_dir=log_dir
        ).start()
        try:
            return _trials(args, cluster, victim, xenv, touch, rng)
        finally:
            cluster.stop()


def _trials(
    args: argparse.Namespace, cluster: LocalCluster, victim: int, xenv: dict[str, str], touch: Any, rng: random.Random
) -> dict[str, Any]:
    apis = [f"http://127.0.0.1:{p}" for p in cluster.api_ports]
    node = f"{apis[victim]}/v1/node"

    def coordinator() -> str | None:
        for a in apis:
            sv = _get(f"{a}/v1/cluster").get("services")
            if sv and sv["state"] == "serving" and len(sv["plan"]) == args.nodes:
                return a
        return None

    def ready() -> str | None:  # every node in the plan, the victim idle and holding a stage
        n = _get(node)
        return coordinator() if n["state"] == "available" and n["stage"]["assigned"] else None

    api = _wait("the cluster to serve on every node", ready, 900, 0.5)
    if _get(f"{api}/v1/node")["node"] == _get(node)["node"]:
        raise BenchError("the node with the display was elected coordinator; run again")
    reference: list[tuple[float, str]] = []
    ref_stats: dict[str, Any] = {}
    stream(api, PROMPT, args.tokens, reference, ref_stats)
    ref_text = "".join(p for _, p in reference)
    rows = []
    for trial in range(args.trials):
        api = _wait("the node back in the plan", ready, 120, 0.25)
        pieces: list[tuple[float, str]] = []
        stats: dict[str, Any] = {}
        t = threading.Thread(target=stream, args=(api, PROMPT, args.tokens, pieces, stats))
        t.start()
        at = rng.randint(8, max(9, args.tokens // 2))
        _wait("the answer to get going", lambda n=at, p=pieces: len(p) >= n, 300, 0.005)
        t_wall, t_mono = time.time(), time.monotonic()
        touch(xenv, rng.randint(0, 1000), rng.randint(0, 700))
        paused = _wait("the node to pause", lambda: (n := _get(node))["state"] == "paused" and n, 10, 0.01)
        # its last step before it stopped: read while it is still paused (it may re-join after
        # IDLE_MINUTES without input, and then compute for the same answer again)
        time.sleep(max(0.0, t_mono + STOP_READ_S - time.monotonic()))
        last = _get(node)["stage"]["last_step_at"] or t_wall
        t.join(900)
        text = "".join(p for _, p in pieces)
        got = int(stats.get("completion_tokens") or 0)
        want = int(ref_stats.get("completion_tokens") or 0)
        row = {
            "trial": trial,
            "after_tokens": at,
            "reason": paused["reason"],
            "stop_ms": round(max(0.0, last - t_wall) * 1000, 1),
            "resume_s": resume_after([ts for ts, _ in pieces], t_mono),
            "tokens": got,
            "tokens_lost": max(0, want - got),
            "tokens_duplicated": max(0, got - want),
            "identical": text == ref_text,
        }
        if row["resume_s"] is not None:
            row["resume_s"] = round(row["resume_s"], 3)
        _say(f"  trial {trial}: {row}")
        rows.append(row)
    stops = [r["stop_ms"] for r in rows]
    resumes = [r["resume_s"] for r in rows if r["resume_s"] is not None]
    return {
        "suite": "throttle",
        "model": args.model,
        "weights": args.weights,
        "nodes": args.nodes,
        "tokens": args.tokens,
        "rows": rows,
        "trials": len(rows),
        "stop_median_ms": round(statistics.median(stops), 1),
        "stop_max_ms": round(max(stops), 1),
        "resume_median_s": round(statistics.median(resumes), 3) if resumes else None,
        "tokens_lost": sum(r["tokens_lost"] for r in rows),
        "tokens_duplicated": sum(r["tokens_duplicated"] for r in rows),
        "outputs_identical": all(r["identical"] for r in rows),
    }
