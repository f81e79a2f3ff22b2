"""``lakeshard bench formation``: from ``cluster init`` with two joins to the first answer, cold and warm.

Three agent processes on loopback, each with a home of its own (its identity, cluster
credentials, logs and compiled-model cache), form a new cluster the way the tray does (``init``
on the first, ``invite`` there, ``join`` on the others, through their local APIs: mutual TLS from
then on), the cluster's model is set on the first (as in the tray's Settings), and a chat
question is asked through another's local API. ``cold_s``: the first time, with empty export
and compile caches (the model itself is already in the store: ``lakeshard models pull`` is its
own step). ``warm_s``: again
with brand-new identities but the caches the first run left (a cluster formed again on laptops
that served before). Both count from the agents' start to the answer's first token.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.common import paths
from coordinator.bench.pipeline import BenchError
from coordinator.lab.local_cluster import LocalCluster, free_port

NODES = 3
QUESTION = "Say hello to the office."


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _first_token(port: int, timeout: float) -> float:
    """Ask through agent ``port``'s local API until it answers; when its first token came."""
    body = json.dumps(
        {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "temperature": 0, "stream": True}
    ).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                for line in r:
                    if line.startswith(b"data: {") and b'"content": "' in line and b'"content": ""' not in line:
                        return time.monotonic()
        except OSError:
            pass
        time.sleep(0.25)
    raise BenchError(f"no answer within {timeout:.0f} s")


def _set_model(port: int, model: str, weights: str) -> None:
    """What the admin does in the tray's Settings: the cluster's model, set on one laptop."""
    body = json.dumps({"model": model, "weights": weights}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/cluster/model",
        data=body,
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
    except urllib.error.HTTPError as e:
        raise BenchError(f"the cluster's model was refused: {e.read().decode(errors='replace')[:300]}") from None


def _form(root: Path, model: str, weights: str, timeout: float) -> Formed:
    """Seconds from the agents' start to the first token of the first answer."""
    homes = [{"LAKESHARD_HOME": str(root / f"agent{i}")} for i in range(NODES)]
    shared = {
        "LAKESHARD_SHARED_CACHE": str(root / "shared"),
        "LAKESHARD_MODELS_DIR": str(paths.models_dir()),
    }
    api = ["--serve-api-port", str(free_port())]  # (another cluster on this machine may have 8000)
    t0 = time.monotonic()
    with LocalCluster(NODES, elect=api, secure=True, form=True, env=shared, agent_envs=homes) as c:
        _set_model(c.api_ports[0], model, weights)
        got = _first_token(c.api_ports[-1], timeout)
        served = _services(c.api_ports)
    ranges = [(int(s["layers"][0]), int(s["layers"][1])) for s in served.get("plan") or []]
    return Formed(got - t0, int(served.get("exported") or 0), ranges)


@dataclass(frozen=True)
class Formed:
    seconds: float  # the agents' start to the first token
    exported: int  # stages the coordinator exported (0: it found an export of its split)
    ranges: list[tuple[int, int]]  # the split it serves


def _services(ports: list[int]) -> dict[str, Any]:
    """The coordinator's services' status (its plan, what it exported), from whichever agent runs them."""
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/cluster", timeout=10) as r:
                st = json.loads(r.read())
        except (OSError, ValueError):
            continue
        if isinstance(st.get("services"), dict):
            return dict(st["services"])
    return {}


def _forget_identities(root: Path) -> None:
    """New laptops' identities (and clusters), but the caches they had."""
    for i in range(NODES):
        for sub in ("config", "state"):
            shutil.rmtree(root / f"agent{i}" / sub, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lakeshard-bench-formation-") as tmp:
        root = Path(tmp)
        cold = _form(root, args.model, args.weights, args.timeout)
        _say(f"cold: first token {cold.seconds:.1f} s after the agents started; split {cold.ranges}")
        _forget_identities(root)
        warm = _form(root, args.model, args.weights, args.timeout)
        _say(f"warm: first token {warm.seconds:.1f} s after the agents started; split {warm.ranges}")
    return {
        "suite": "formation",
        "model": args.model,
        "weights": args.weights,
        "nodes": NODES,
        "cold_s": round(cold.seconds, 2),
        "warm_s": round(warm.seconds, 2),
        "answered": True,
        "cold_split": cold.ranges,
        "warm_split": warm.ranges,
        "warm_exported_stages": warm.exported,  # 0: the warm cluster found the export it needed
    }
