"""``lakeshard demo`` (what ``make run`` runs): a local cluster forms itself and answers a chat.

Agent processes start on this machine (each pinned to its own cores where there are enough),
find each other (loopback peers: multicast is not dependable on loopback), elect a
coordinator, which plans the model over them, hands out the stages and serves the API; then
one chat is streamed through it. Nobody types an address.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from agent.models.registry import REGISTRY
from agent.models.store import ModelStore
from coordinator.api.chat_client import stream_chat
from coordinator.lab.local_cluster import LocalCluster, free_port

FORM_TIMEOUT_S = 900.0  # the first run exports the model


def _get(port: int, path: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_demo(args: argparse.Namespace) -> int:
    model = ModelStore().resolve(args.model)
    spec = REGISTRY.get(model.name)
    weights = args.weights or (spec.default_weights if spec else "int4")
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per = max(1, ncpu // args.nodes)
    cores = [list(range(i * per, (i + 1) * per)) for i in range(args.nodes)] if ncpu >= args.nodes else None
    api_port = free_port()
    # a throwaway cluster of its own (a new CA): the agents talk mutual TLS, as laptops do
    elect = ["--serve-model", args.model, "--serve-weights", weights]
    elect += ["--serve-api-port", str(api_port)]
    _say(f"starting {args.nodes} agent processes" + (f", {per} core(s) each" if cores else ""))
    with LocalCluster(args.nodes, cores=cores, elect=elect, secure=True, form=True) as cluster:
        _say(f"a throwaway cluster {cluster.cluster_id}: mutual TLS between the agents")
        sv = _wait_for_pipeline(cluster)
        url = f"http://127.0.0.1:{api_port}"
        _say(f"coordinator API: {url}/v1\n\n> {args.prompt}\n")
        t0, n = time.monotonic(), 0
        msgs = [{"role": "user", "content": args.prompt}]
        for d in stream_chat(url, msgs, max_tokens=args.max_tokens, temperature=0.0):
            n += 1
            sys.stdout.write(d)
            sys.stdout.flush()
        sys.stdout.write("\n")
        _say(f"[{n} chunks in {time.monotonic() - t0:.1f}s through {len(sv['plan'])} stage(s)]")
    return 0


def _wait_for_pipeline(cluster: LocalCluster) -> dict[str, Any]:
    deadline = time.monotonic() + FORM_TIMEOUT_S
    said: set[str] = set()
    while time.monotonic() < deadline:
        for port in cluster.api_ports:
            c = _get(port, "/v1/cluster")
            if not c or c.get("role") != "coordinator":
                continue
            if "elected" not in said:
                said.add("elected")
                _say(f"agent {c['node']} elected coordinator (term {c['term']}); planning and assigning the stages")
            sv = c.get("services") or {}
            if sv.get("state") == "failed":
                raise RuntimeError(f"the coordinator could not form the pipeline: {sv.get('error')}")
            if sv.get("state") == "serving":
                for i, st in enumerate(sv["plan"]):
                    a, b = st["layers"]
                    _say(f"stage {i}: layers {a}..{b - 1} on agent {st['node']} ({st['address']})")
                return dict(sv)
        for p in cluster.procs:
            if p.poll() is not None:
                raise RuntimeError(f"an agent exited with status {p.returncode}")
        time.sleep(0.3)
    raise RuntimeError(f"no pipeline formed within {FORM_TIMEOUT_S:.0f}s")
