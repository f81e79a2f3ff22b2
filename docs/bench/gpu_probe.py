"""What OpenVINO's GPU plugin makes of our stage IRs (issue 25's first look, on the lent machine).

    python3 docs/bench/gpu_probe.py [--model smollm2-135m] [--tokens 48] [--out DIR]

For each device OpenVINO lists: its full name and reported capabilities. Then, with random
weights of the model's shapes (nothing to download), INT8 and FP32 exports of 1 and 2 stages,
with and without the beam_idx Gather: greedy tokens and decode tok/s of each variant on the GPU
(exact mode: f32 activations and KV) against the same IR on the CPU, and which compile
properties the GPU accepted. Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _devices() -> dict[str, Any]:
    import openvino as ov

    core = ov.Core()
    out: dict[str, Any] = {}
    for d in core.available_devices:
        info: dict[str, Any] = {}
        for prop in ("FULL_DEVICE_NAME", "OPTIMIZATION_CAPABILITIES", "DEVICE_TYPE", "GPU_DEVICE_TOTAL_MEM_SIZE"):
            try:
                v = core.get_property(d, prop)
                info[prop] = (
                    v if isinstance(v, int | float | str) else [str(x) for x in v] if isinstance(v, list) else str(v)
                )
            except Exception as e:  # a property the device does not have
                info[prop] = f"(no: {type(e).__name__})"
        out[d] = info
    return out


def _run(export_dir: Path, device: str, prompt: list[int], tokens: int, exact: bool) -> dict[str, Any]:
    from agent.runtime.chain import Chain

    t0 = time.perf_counter()
    chain = Chain.load(export_dir, device=device, exact=exact)
    compile_s = time.perf_counter() - t0
    chain.generate(prompt, max_tokens=4)  # warm
    g = chain.generate(prompt, max_tokens=tokens)
    rate = (len(g.tokens) - 1) / g.decode_s if g.decode_s > 0 else None
    return {"tokens": g.tokens, "tok_s": None if rate is None else round(rate, 2), "compile_s": round(compile_s, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--init-range",
        type=float,
        help="random weights with this std (the config's 0.02 gives the same token at every step)",
    )
    ap.add_argument("--exact-only", action="store_true", help="only exact mode (f32 activations and KV)")
    args = ap.parse_args()
    from agent.export.exporter import ExportOptions, export_model
    from coordinator.bench.pipeline import resolve_model, synthetic_ids
    from coordinator.planning.planner import balanced_split, model_costs

    result: dict[str, Any] = {"suite": "gpu_probe", "model": args.model, "devices": _devices(), "runs": []}
    print(json.dumps(result["devices"], indent=1), flush=True)
    gpu = next((d for d in result["devices"] if d.startswith("GPU")), None)
    model = resolve_model(args.model, True, True)
    if args.init_range:
        import tempfile

        from agent.models.store import LocalModel

        cfg = json.loads((model.dir / "config.json").read_text())
        cfg["initializer_range"] = args.init_range
        d = Path(tempfile.mkdtemp(prefix="gpu-probe-")) / args.model
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(cfg))
        model = LocalModel.synthetic(d, args.model)
        result["initializer_range"] = args.init_range
    prompt = synthetic_ids(24, 2000)
    variants = [("int8", True, 1), ("int8", True, 2), ("int8", False, 1), ("fp32", True, 1), ("fp32", True, 2)]
    for weights, beam, n in variants:
        ranges = balanced_split(model_costs(model.config()), n)
        try:
            ex = export_model(model, ranges, ExportOptions(weights=weights, beam_idx=beam), quiet=True)
        except Exception as e:
            result["runs"].append({"weights": weights, "beam_idx": beam, "stages": n, "export_error": str(e)})
            continue
        modes = (True,) if args.exact_only else (True, False)
        for device, exact in [(d, x) for d in ("CPU", gpu) if d for x in modes]:
            row: dict[str, Any] = {"weights": weights, "beam_idx": beam, "stages": n, "device": device, "exact": exact}
            try:
                row.update(_run(ex.dir, device, prompt, args.tokens, exact))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                traceback.print_exc()
            toks = row.pop("tokens", None)
            row["first_tokens"] = toks[:8] if toks else None
            row["all_tokens"] = toks
            print(json.dumps({k: v for k, v in row.items() if k != "all_tokens"}), flush=True)
            result["runs"].append(row)
            if args.out:  # what is done so far comes back even if the call runs out of time
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "gpu_probe_partial.json").write_text(json.dumps(result))
    # agreement: each run against the CPU exact 1-stage run of the same weights and Gather setting
    for row in result["runs"]:
        ref = next(
            (
                r
                for r in result["runs"]
                if r.get("device") == "CPU"
                and r.get("exact")
                and r["stages"] == 1
                and r["weights"] == row["weights"]
                and r["beam_idx"] == row["beam_idx"]
            ),
            None,
        )
        a, b = row.get("all_tokens"), (ref or {}).get("all_tokens")
        if a and b:
            row["agree_with_cpu_exact"] = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a)
            )
    for row in result["runs"]:
        row.pop("all_tokens", None)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_probe.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
