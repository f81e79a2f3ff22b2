"""``lakeshard bench failover --kill coordinator``: what a user sees when the coordinator dies mid-answer.

``--nodes`` elected agent processes on loopback (each its own home; models and exports in one
shared cache, as on laptops that hold copies) serve the model in exact mode (f32 activations,
KV and wire: every split gives the same greedy tokens). Each trial streams a greedy answer
through a non-coordinator agent's local API (the tray's door), SIGKILLs the coordinator after a
random token, and measures the time from the kill to the next token at the client; the agent is
started again after the trial (a laptop back), and the next trial waits until the cluster serves
with its fallback split prepared. Tokens are compared with an undisturbed answer (the client asks
for the ids behind each chunk, as the gateway does), and each new coordinator says whether it
had to export anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from agent.api.resume import RESUME_HEADER
from agent.common import aio
from agent.node.capacity import probe
from coordinator.bench.failover import QUESTION, compare
from coordinator.bench.pipeline import BenchError
from coordinator.lab.local_cluster import LocalCluster, free_port


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _services(c: LocalCluster, i: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{c.api_ports[i]}/v1/cluster", timeout=5) as r:
            sv = json.loads(r.read()).get("services")
            return sv if isinstance(sv, dict) else None
    except (OSError, ValueError):
        return None


def serving(c: LocalCluster, among: list[int], timeout: float, ready: bool = True) -> int:
    """The agent among ``among`` whose coordinator serves (``ready``: with its exports announced)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i in among:
            sv = _services(c, i)
            if sv and sv.get("state") == "failed":
                raise BenchError(f"the coordinator could not form the pipeline: {sv.get('error')}")
            prepared = len(sv.get("needed_exports") or []) >= min(len(sv.get("plan") or []), 2) if sv else False
            if sv and sv.get("state") == "serving" and (prepared or not ready):
                return i
        time.sleep(0.25)
    raise BenchError(f"no coordinator served within {timeout:.0f} s")


def _node(c: LocalCluster, i: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{c.api_ports[i]}/v1/node", timeout=5) as r:
            got = json.loads(r.read())
            return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}


def settled(c: LocalCluster, timeout: float, quiet_s: float = 5.0) -> int:
    """Wait until the cluster is as a takeover expects it (warm): one coordinator serving with its
    fallback prepared, every node holding a copy of the cluster's exports, nothing changing for
    ``quiet_s``; the coordinator's index."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        ci = serving(c, list(range(c.n)), max(1.0, deadline - time.monotonic()))
        sv = _services(c, ci) or {}
        needed = set(sv.get("needed_exports") or [])
        held = [set((_node(c, i).get("exports") or {}).get("held") or []) for i in range(c.n)]
        state = (ci, tuple(sorted(needed)), tuple(str(p.get("node")) for p in sv.get("plan") or []))
        if state != last or not all(needed <= h for h in held):
            last, since = state, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return ci
        time.sleep(0.5)
    raise BenchError(f"the cluster did not settle within {timeout:.0f} s")


async def stream_ids(port: int, tokens: int, on_token: Any = None) -> tuple[list[int], list[float]]:
    """A greedy answer through agent ``port``'s local API: its token ids, and when each chunk came
    (a 503 before it starts, an election under way, is asked again for up to a minute)."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": tokens, "temperature": 0}
    ids: list[int] = []
    times: list[float] = []
    timeout = aiohttp.ClientTimeout(total=600)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.post(url, json={**body, "stream": True}, headers={RESUME_HEADER: "1"}, timeout=timeout) as r:
                if r.status == 503 and time.monotonic() < deadline:
                    await asyncio.sleep(0.5)
                    continue
                if r.status != 200:
                    raise BenchError(f"HTTP {r.status}: {(await r.text())[:300]}")
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        raise BenchError(f"the answer failed: {obj['error']}")
                    new = (obj.get("lakeshard") or {}).get("ids") or []
                    if new:
                        ids.extend(new)
                        times.append(time.monotonic())
                        if on_token is not None:
                            on_token(len(ids))
                return ids, times


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.nodes < 2:
        raise BenchError("--nodes must be at least 2 (a takeover needs a survivor)")
    rng = random.Random(args.seed)
    serve = ["--serve-model", args.model, "--serve-weights", args.weights, "--serve-exact"]
    serve += ["--serve-api-port", str(free_port())]  # (another cluster on this machine may have 8000)
    config = f"serve:\n  min_nodes: {min(args.nodes, 2)}\n"
    with tempfile.TemporaryDirectory(prefix="lakeshard-bench-takeover-") as tmp:
        speed = Path(tmp) / "capacity.json"  # identical laptops: one plan, exported once (then cached)
        probe(cache_file=speed, requested="CPU")
        return _trials(args, serve, config, speed, rng)


def _trials(args: argparse.Namespace, serve: list[str], config: str, speed: Path, rng: random.Random) -> dict[str, Any]:
    pauses: list[float] = []
    lost = dup = 0
    identical, reexported = True, False
    seconds: list[float] = []
    with LocalCluster(args.nodes, elect=serve, config=config, capacity=speed) as c:
        ci = serving(c, list(range(args.nodes)), 1800)
        far = next(i for i in range(args.nodes) if i != ci)
        ref, _ = aio.run(stream_ids(c.api_ports[far], args.tokens))
        _say(f"reference: {len(ref)} tokens through agent {far}, coordinator {ci}")
        for trial in range(args.trials):
            ci = settled(c, 1800)
            far = next(i for i in range(args.nodes) if i != ci)
            at = rng.randrange(5, max(6, len(ref) - 5))
            killed: list[float] = []

            def kill_at(n: int, ci: int = ci, at: int = at, killed: list[float] = killed) -> None:
                if not killed and n >= at:
                    c.kill(ci)
                    killed.append(time.monotonic())

            out, times = aio.run(stream_ids(c.api_ports[far], args.tokens, kill_at))
            if not killed:
                raise BenchError(f"trial {trial}: the answer ended before token {at}")
            after = [t for t in times if t > killed[0]]
            if not after:
                raise BenchError(f"trial {trial}: no token came after the kill")
            pause = after[0] - killed[0]
            lo, du, same = compare(ref, out, len([t for t in times if t <= killed[0]]))
            lost, dup, identical = lost + lo, dup + du, identical and same
            cj = serving(c, [i for i in range(args.nodes) if i != ci], 120, ready=False)
            sv = _services(c, cj) or {}
            exported = int(sv.get("exported") or 0) > 0
            reexported = reexported or exported
            adopted = sv.get("adopted") or {}
            if adopted:
                seconds.append(float(adopted.get("seconds", 0.0)))
            pauses.append(pause)
            how = f"kept {adopted.get('kept')}, moved {adopted.get('moved')}" if adopted else "no (planned afresh)"
            diff = "" if same else f", DIFFERENT text (lost {lo}, duplicated {du})"
            _say(
                f"trial {trial + 1}/{args.trials}: coordinator killed after token {at}: next token {pause:.2f} s "
                f"later; taken over: {how}{', EXPORTED again' if exported else ''}{diff}"
            )
            c.restart(ci)
    return {
        "trials": args.trials,
        "nodes": args.nodes,
        "kill": "coordinator",
        "model": args.model,
        "weights": args.weights,
        "tokens": args.tokens,
        "recovery_median_s": round(statistics.median(pauses), 3),
        "recovery_max_s": round(max(pauses), 3),
        "outputs_identical": identical,
        "tokens_lost": lost,
        "tokens_duplicated": dup,
        "reexported": reexported,
        "takeover_s": [round(s, 3) for s in seconds],
        "recovery_s": [round(p, 3) for p in pauses],
    }
