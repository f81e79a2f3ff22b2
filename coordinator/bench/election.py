"""``lakeshard bench election``: failover and discovery times of real agents on a namespace LAN.

Root only. ``--nodes`` agents, each in its own network namespace on one bridge (real
multicast mDNS, real UDP). Each trial SIGKILLs the coordinator and measures the time from
the kill to the moment the last survivor admitted the new coordinator (from the agents' own
timestamps, so polling does not inflate it). Then a brand-new node (fresh id) starts in the
dead one's place, and the trial measures the time from the agent's start (its networking up)
to its first beat heard by every other node; ``spawn_to_seen`` also counts Python's start-up.

``--formation N`` first times N cold starts of a plaintext cluster and of a secure one (the
user's ``cluster init``/``invite``/``join`` in the namespaces, then mutual TLS and signed
election datagrams), alternating, to the moment every node agrees on one coordinator.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.common import paths
from coordinator.bench.pipeline import BenchError
from coordinator.lab import netns
from coordinator.lab.agents import AgentLab, agreed

BOOT_S = 180.0
ELECT_S = 60.0


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _admitted_at(v: dict[str, Any], coord: str) -> float:
    return float(max(h["at"] for h in v["history"] if h["coordinator"] == coord))


def _replaced(old: str | None, survivors: int) -> Callable[[dict[int, dict[str, Any] | None]], bool]:
    return lambda v: agreed(v, peers_alive=survivors - 1) not in (None, old)


def formation(n: int, trials: int) -> dict[str, Any]:
    """Cold starts, alternating: ``n`` plaintext agents started at once, and a secure cluster formed
    as a user would (``cluster init``, the first agent, ``invite``, ``n - 1`` joins at once, their
    agents); each timed from the first command to every node agreeing on one coordinator. Every
    node reuses one speed score (no micro-benchmark on cores the other agents load)."""
    speed = paths.cache_dir() / "capacity.json"
    times: dict[str, list[float]] = {"plaintext": [], "secure": [], "secure_first_up": [], "secure_joined": []}
    for trial in range(trials):
        for secure in (False, True):
            with (
                tempfile.TemporaryDirectory(prefix="lakeshard-bench-formation-") as tmp,
                AgentLab(n, Path(tmp), cluster="formation", split=n, secure=secure, capacity=speed) as lab,
            ):
                t0 = time.monotonic()
                lab.start_all()
                view = lab.wait_for(lambda v: agreed(v, peers_alive=n - 1) is not None, range(n), BOOT_S)
                took = time.monotonic() - t0
                modes = {(v["links"], v["election_traffic"]["mode"]) for v in view.values() if v}
                want = ("TLS", "signed") if secure else ("PLAINTEXT", "plaintext")
                if modes != {want}:
                    raise BenchError(f"formation trial {trial}: links/election traffic {modes}, expected {want}")
                times["secure" if secure else "plaintext"].append(took)
                if secure:
                    times["secure_first_up"].append(lab.marks["first_up"] - t0)
                    times["secure_joined"].append(lab.marks["joined"] - t0)
                _say(f"formation {trial + 1}/{trials}: {'secure' if secure else 'plaintext'} {took:.2f}s")
    out: dict[str, Any] = {f"{k}_median_s": round(statistics.median(v), 3) for k, v in times.items()}
    return out | {f"{k}_s": [round(x, 3) for x in v] for k, v in times.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    why = netns.available()
    if why:
        raise BenchError(f"bench election builds network namespaces: {why}")
    if args.nodes < 3:
        raise BenchError("--nodes must be at least 3 (a failover needs two survivors)")
    n = args.nodes
    formed = formation(n, args.formation) if getattr(args, "formation", 0) > 0 else None
    failover: list[float] = []
    discovery: list[float] = []
    spawn: list[float] = []
    with (
        tempfile.TemporaryDirectory(prefix="lakeshard-bench-election-") as tmp,
        AgentLab(n, Path(tmp), cluster=f"bench-{int(time.time())}", split=n) as lab,
    ):
        lab.start_all()
        view = lab.wait_for(lambda v: agreed(v, peers_alive=n - 1) is not None, range(n), BOOT_S)
        _say(f"{n} agents agree on coordinator {agreed(view)}")
        for trial in range(args.trials):
            coord = agreed(view)
            dead = next(i for i, v in view.items() if v and v["node"] == coord)
            t_kill = lab.kill(dead)
            rest = [i for i in range(n) if i != dead]
            after = lab.wait_for(_replaced(coord, n - 1), rest, ELECT_S)
            new = agreed(after)
            assert new is not None
            f = max(_admitted_at(v, new) for v in after.values() if v) - t_kill
            failover.append(f)
            lab.start(dead, fresh=True)
            view = lab.wait_for(lambda v: agreed(v, peers_alive=n - 1) is not None, range(n), BOOT_S)
            joined = lab.get(dead, "/v1/node")
            if joined is None:
                raise BenchError("the restarted agent stopped answering")
            heard = [
                p["first_heard"] for i in rest for p in (view[i] or {}).get("peers", []) if p["node"] == joined["node"]
            ]
            if len(heard) != n - 1 or None in heard:
                raise BenchError(f"trial {trial}: the new node was not heard by every peer")
            discovery.append(max(heard) - joined["started"])
            spawn.append(max(heard) - lab.spawned_at[dead])
            _say(
                f"trial {trial + 1}/{args.trials}: failover {f:.2f}s (new coordinator {new}), "
                f"discovery {discovery[-1]:.2f}s ({spawn[-1]:.2f}s from process spawn)"
            )
    return {
        "nodes": n,
        "trials": args.trials,
        "failover_median_s": round(statistics.median(failover), 3),
        "failover_max_s": round(max(failover), 3),
        "discovery_median_s": round(statistics.median(discovery), 3),
        "discovery_max_s": round(max(discovery), 3),
        "spawn_to_seen_median_s": round(statistics.median(spawn), 3),
        "failover_s": [round(x, 3) for x in failover],
        "discovery_s": [round(x, 3) for x in discovery],
    } | ({"formation": formed} if formed else {})
