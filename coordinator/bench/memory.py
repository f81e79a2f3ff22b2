"""``lakeshard bench memory``: what one more stream costs a stage agent.

One agent process serves the whole model; streams are opened one by one, each with a long
prompt, and the agent's resident memory is read after each. The growth per stream is set
beside the stream's KV cache size. Each attention is measured in its own agent:

- stateful: one compiled model and one InferRequest per stream, so a stream should cost its KV
  cache and its request's working buffers, never another copy of the weights;
- paged: the KV block pool is allocated (and zeroed) when the stage compiles, so the agent's
  memory is bounded from the start and a stream only takes blocks of it: the JSON gives the
  pool's size, the blocks each stream took and their bytes, beside the RSS growth.
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


async def _grow(cfg: ServeConfig, streams: int, prompt_tokens: int) -> list[dict[str, Any]]:
    """The stage's status before and after each stream is opened."""
    coord = Coordinator(cfg)
    await coord.async_start()
    try:
        assert coord.pipeline is not None
        pipe = coord.pipeline
        prompt = synthetic_ids(prompt_tokens)
        seen = [_node(cfg.nodes[0])]
        for _ in range(streams):
            sid = pipe.new_stream()
            await pipe.send_step(sid, prompt, start=True)  # the stream stays open: its KV stays
            seen.append(_node(cfg.nodes[0]))
        return seen
    finally:
        await coord.async_stop()


def _measure(attention: str, model: Any, opts: ExportOptions, args: argparse.Namespace) -> dict[str, Any]:
    with LocalCluster(1, device="CPU", attention=attention) as cluster:
        cfg = ServeConfig(
            nodes=cluster.nodes, model=model, opts=opts, transport=PLAINTEXT, api_port=0, quiet=True, api=False
        )
        seen = aio.run(_grow(cfg, args.streams, args.prompt_tokens))
    rss = [float(s["rss_mb"]) for s in seen]
    out: dict[str, Any] = {
        "attention": seen[0].get("attention") or attention,
        "rss_mb": rss,
        "per_stream_mb": [round(b - a, 1) for a, b in itertools.pairwise(rss)],
    }
    if out["attention"] == "paged":
        free = [int(s["kv_blocks_free"]) for s in seen]
        block_mb = float(seen[0]["kv_pool_mb"]) / max(1, int(seen[0]["kv_blocks_total"]))
        out.update(
            kv_pool_mb=seen[0]["kv_pool_mb"],
            kv_block_tokens=seen[0]["kv_block_tokens"],
            blocks_per_stream=[a - b for a, b in itertools.pairwise(free)],
            blocks_mb_per_stream=[round((a - b) * block_mb, 1) for a, b in itertools.pairwise(free)],
        )
    return out


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
    runs = [_measure(a, model, opts, args) for a in args.attention]
    return {
        "suite": "memory",
        "model": model.name,
        "weights": opts.weights,
        "prompt_tokens": args.prompt_tokens,
        # the first attention's figures at the top, as before; every attention's under "runs"
        "rss_mb": runs[0]["rss_mb"],
        "per_stream_mb": runs[0]["per_stream_mb"],
        "runs": runs,
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
