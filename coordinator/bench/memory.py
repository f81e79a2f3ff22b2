"""``lakeshard bench memory``: what one more stream costs a stage agent.

One agent process serves the whole model; streams are opened one by one, each with a long
prompt, and the agent's resident memory is read after each. The growth per stream is set
beside the stream's KV cache size: with one compiled model and one InferRequest per
stream, a stream should cost its KV cache and its request's working buffers, never another
copy of the weights.
"""

from __future__ import annotations

import argparse
import itertools
import json
import urllib.request
from typing import Any

from agent.common import aio
from agent.export.exporter import ExportOptions, export_model
from agent.models.registry import REGISTRY
from agent.runtime.device_profile import compile_properties
from agent.security.transport import PLAINTEXT
from coordinator.bench.pipeline import resolve_model, synthetic_ids
from coordinator.lab.local_cluster import LocalCluster
from coordinator.service.config import ServeConfig
from coordinator.service.coordinator import Coordinator


def _node(node: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{node}/v1/node", timeout=10) as r:
        result: dict[str, Any] = json.loads(r.read())["stage"]
        return result


async def _grow(cfg: ServeConfig, streams: int, prompt_tokens: int) -> list[float]:
    coord = Coordinator(cfg)
    await coord.async_start()
    try:
        assert coord.pipeline is not None
        pipe = coord.pipeline
        prompt = synthetic_ids(prompt_tokens)
        rss = [_node(cfg.nodes[0])["rss_mb"]]
        for _ in range(streams):
            sid = pipe.new_stream()
            await pipe.send_step(sid, prompt, start=True)  # the stream stays open: its KV stays
            rss.append(_node(cfg.nodes[0])["rss_mb"])
        return rss
    finally:
        await coord.async_stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model(args.model, args.random_weights, bool(args.json))
    spec = REGISTRY.get(args.model)
    opts = ExportOptions(weights=args.weights or (spec.default_weights if spec else "int4"))
    export_model(model, [(0, model.num_layers)], opts, quiet=bool(args.json))
    cfg_json = json.loads((model.dir / "config.json").read_text())
    hd = cfg_json.get("head_dim") or cfg_json["hidden_size"] // cfg_json["num_attention_heads"]
    kv_precision = str(compile_properties("CPU").get("KV_CACHE_PRECISION", "f16"))  # what the agent compiles with
    elem = {"f32": 4, "f16": 2, "u8": 1}.get(kv_precision, 2)
    kv_mb = 2 * cfg_json["num_hidden_layers"] * cfg_json["num_key_value_heads"] * hd * args.prompt_tokens * elem / 2**20
    with LocalCluster(1, device="CPU") as cluster:
        cfg = ServeConfig(
            nodes=cluster.nodes, model=model, opts=opts, transport=PLAINTEXT, api_port=0, quiet=True, api=False
        )
        rss = aio.run(_grow(cfg, args.streams, args.prompt_tokens))
    deltas = [round(b - a, 1) for a, b in itertools.pairwise(rss)]
    return {
        "suite": "memory",
        "model": model.name,
        "weights": opts.weights,
        "prompt_tokens": args.prompt_tokens,
        "rss_mb": rss,
        "per_stream_mb": deltas,
        "kv_precision": kv_precision,
        "kv_mb_per_stream": round(kv_mb, 1),
        "model_bin_mb": round(
            sum(
                f.stat().st_size
                for f in export_model(model, [(0, model.num_layers)], opts, quiet=True).dir.rglob("*.bin")
            )
            / 2**20,
            1,
        ),
    }
