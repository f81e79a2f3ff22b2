"""OpenVINO device choice and compile properties (GPU/NPU used when present, CPU otherwise)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import openvino as ov

from agent.paths import compiled_cache_dir

log = logging.getLogger(__name__)
_core: ov.Core | None = None
DEFAULT_CACHE_MB = 4096  # compiled blobs of fp32 stages run to hundreds of MB each


class DeviceError(ValueError):
    pass


def core() -> ov.Core:
    """One OpenVINO Core per process, with the compiled-model cache switched on."""
    global _core
    if _core is None:
        _core = ov.Core()
        if not os.environ.get("LAKESHARD_NO_COMPILE_CACHE"):
            _core.set_property({"CACHE_DIR": str(compiled_cache_dir())})
    return _core


def compile_model(xml: Path, device: str, props: dict[str, Any]) -> ov.CompiledModel:
    """Compile (or load from the compiled-model cache), then keep that cache within its cap."""
    compiled = core().compile_model(str(xml), device, props)
    prune_compiled_cache()
    return compiled


def cache_cap_bytes() -> int:
    """The compiled-model cache's cap: ``LAKESHARD_COMPILE_CACHE_MB`` (default 4096)."""
    v = os.environ.get("LAKESHARD_COMPILE_CACHE_MB", "")
    try:
        mb = float(v) if v else DEFAULT_CACHE_MB
    except ValueError:
        raise DeviceError(f"LAKESHARD_COMPILE_CACHE_MB must be a number of megabytes, not {v!r}") from None
    return int(max(0.0, mb) * 2**20)


def prune_compiled_cache(folder: Path | None = None, cap: int | None = None) -> list[Path]:
    """Delete the least recently used compiled blobs until the folder fits under ``cap`` bytes.

    Safe beside other agents: a blob another process has open stays readable until closed,
    and a deleted blob only means that model compiles from its IR again next time.
    """
    d = folder if folder is not None else compiled_cache_dir()
    limit = cache_cap_bytes() if cap is None else cap
    entries = []
    for f in d.iterdir():
        try:
            st = f.stat()
        except OSError:  # removed by another process meanwhile
            continue
        if f.is_file():
            entries.append((max(st.st_atime, st.st_mtime), st.st_size, f))
    total = sum(e[1] for e in entries)
    removed = []
    for _, size, f in sorted(entries):
        if total <= limit:
            break
        try:
            f.unlink()
        except OSError:
            continue
        total -= size
        removed.append(f)
    if removed:
        log.info("compiled-model cache over %d MB: removed %d old blob(s)", limit >> 20, len(removed))
    return removed


def available_devices() -> list[str]:
    return list(core().available_devices)


def device_names() -> dict[str, str]:
    """Device id -> full name (e.g. 'GPU.0' -> 'Intel(R) Arc(TM) Graphics')."""
    out = {}
    for d in available_devices():
        try:
            out[d] = str(core().get_property(d, "FULL_DEVICE_NAME"))
        except RuntimeError:
            out[d] = d
    return out


def choose_device(requested: str = "AUTO") -> str:
    """AUTO picks an Intel GPU when OpenVINO sees one, else the CPU.

    Stage IRs have dynamic shapes, which the NPU plugin does not run as-is: NPU is used only
    when asked for explicitly.
    """
    req = (requested or "AUTO").upper()
    devs = available_devices()
    if req == "AUTO":
        gpus = [d for d in devs if d.startswith("GPU")]
        return gpus[0] if gpus else "CPU"
    if req in devs or any(d.split(".")[0] == req for d in devs):
        return req
    raise DeviceError(f"device {requested!r} is not available; OpenVINO sees: {', '.join(devs) or 'nothing'}")


def compile_properties(
    device: str, *, threads: int | None = None, exact: bool = False, kv_precision: str | None = None
) -> dict[str, Any]:
    """Properties for compiling a stage. ``exact`` = f32 everywhere (for parity tests).

    On CPU, activations are f32 by default: with compressed (INT4/INT8) weights, decode ran
    29% faster in f32 than in the plugin's bf16 default on an AMX Xeon (Qwen2.5-0.5B INT4,
    2 threads: 43.6 vs 33.9 tok/s), the bf16 path paying for conversions that a one-token
    step cannot amortise. ``LAKESHARD_CPU_PRECISION=bf16`` restores the plugin default.
    """
    props: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
    kind = device.split(".")[0]
    if kind in ("CPU", "GPU"):
        props["KV_CACHE_PRECISION"] = "f32" if exact else (kv_precision or "f16")
    if exact:
        props["INFERENCE_PRECISION_HINT"] = "f32"
        if kind == "CPU":
            # no dynamic int8 quantization of activations: it groups tokens, so a result would
            # depend on how many tokens share a call (prefill vs steps, verify vs decode)
            props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
    elif kind == "CPU":
        prec = os.environ.get("LAKESHARD_CPU_PRECISION", "f32")
        if prec not in ("f32", "bf16", "f16"):
            raise DeviceError(f"LAKESHARD_CPU_PRECISION must be f32, bf16 or f16, not {prec!r}")
        props["INFERENCE_PRECISION_HINT"] = prec
    if kind == "CPU" and threads:
        props["INFERENCE_NUM_THREADS"] = int(threads)
    return props
