"""This machine's capacity probe: OpenVINO devices, a cached per-device speed score, and fresh memory figures.

Speed scores come from a short MatMul micro-benchmark (GFLOP/s) and are cached per device under a fingerprint
of the hardware, driver and OpenVINO version, so they are re-measured only when one of those changes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import psutil
from openvino import opset13 as ops

from agent import paths

log = logging.getLogger(__name__)

CACHE_VERSION = 1
_DRIVER_PROPS = ("DRIVER_VERSION", "GPU_DRIVER_VERSION", "NPU_DRIVER_VERSION")
_BATCH, _WIDTH, _LAYERS = 8, 1024, 4


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    kind: str
    full_name: str
    driver: str
    score: float
    error: str = ""


@dataclass(frozen=True)
class Capacity:
    devices: tuple[DeviceInfo, ...]
    mem_total: int
    mem_free: int
    cpu_count: int
    speed_score: float
    best_device: str

    def kinds(self) -> list[str]:
        return sorted({d.kind for d in self.devices})

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["devices"] = [asdict(x) for x in self.devices]
        d["kinds"] = self.kinds()
        return d


def free_memory() -> int:
    """Available memory in bytes, read fresh."""
    return int(psutil.virtual_memory().available)


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _prop(core: ov.Core, device: str, name: str) -> str:
    try:
        v = core.get_property(device, name)
    except Exception:
        return ""
    return str(v).strip() if v is not None else ""


def _driver(core: ov.Core, device: str) -> str:
    for p in _DRIVER_PROPS:
        if v := _prop(core, device, p):
            return v
    return ""


def fingerprint(name: str, full_name: str, driver: str) -> str:
    """Identity of a device's measured speed: changes with the hardware, driver, OpenVINO build or core count."""
    parts = [name, full_name, driver, ov.get_version(), platform.machine(), str(usable_cpus())]
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


def _bench_model() -> ov.Model:
    rng = np.random.default_rng(0)
    x = ops.parameter([_BATCH, _WIDTH], ov.Type.f32, name="x")
    h: Any = x
    for i in range(_LAYERS):
        w = (rng.standard_normal((_WIDTH, _WIDTH)) / np.sqrt(_WIDTH)).astype(np.float32)
        h = ops.matmul(h, ops.constant(w), transpose_a=False, transpose_b=False)
        if i < _LAYERS - 1:
            h = ops.relu(h)
    return ov.Model([h], [x], "lakeshard-speed")


def speed_benchmark(device: str, seconds: float = 0.3, *, core: ov.Core | None = None) -> float:
    """Blocking micro-benchmark of decode-like MatMuls on ``device``; returns GFLOP/s. Call it from a thread."""
    core = core or ov.Core()
    compiled = core.compile_model(_bench_model(), device, {"PERFORMANCE_HINT": "LATENCY"})
    req = compiled.create_infer_request()
    x = np.random.default_rng(1).standard_normal((_BATCH, _WIDTH)).astype(np.float32)
    for _ in range(3):
        req.infer([x])
    calls, t0 = 0, time.perf_counter()
    while True:
        req.infer([x])
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    flops = 2.0 * _BATCH * _WIDTH * _WIDTH * _LAYERS * calls
    return flops / elapsed / 1e9


def _load_cache(path: Path) -> dict[str, dict[str, Any]]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("capacity cache %s unreadable, ignoring: %s", path, e)
        return {}
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            raise ValueError("unexpected layout or version")
        devs = data.get("devices")
        if not isinstance(devs, dict):
            raise ValueError("no devices map")
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        log.warning("capacity cache %s is corrupt, ignoring: %s", path, e)
        return {}
    return {
        k: v
        for k, v in devs.items()
        if isinstance(v, dict)
        and isinstance(v.get("fingerprint"), str)
        and isinstance(v.get("score"), (int, float))
        and not isinstance(v.get("score"), bool)
    }


def _write_cache(path: Path, entries: dict[str, dict[str, Any]]) -> None:
    paths.write_json_atomic(path, {"version": CACHE_VERSION, "devices": entries}, indent=2, sort_keys=True)


def probe(
    cache_file: Path | None = None,
    *,
    refresh: bool = False,
    bench_seconds: float = 0.3,
    devices: list[str] | None = None,
) -> Capacity:
    """Describe this machine. Speed scores are reused from the cache when the device fingerprint matches."""
    path = cache_file if cache_file is not None else paths.cache_dir() / "capacity.json"
    core = ov.Core()
    names = list(devices) if devices is not None else list(core.available_devices)
    cache = _load_cache(path)
    infos: list[DeviceInfo] = []
    dirty = False
    for name in names:
        full_name, driver = _prop(core, name, "FULL_DEVICE_NAME"), _driver(core, name)
        fp = fingerprint(name, full_name, driver)
        entry = cache.get(name)
        if not refresh and entry is not None and entry["fingerprint"] == fp:
            score, error = float(entry["score"]), ""
        else:
            try:
                score, error = speed_benchmark(name, bench_seconds, core=core), ""
            except Exception as e:
                log.warning("speed benchmark failed on %s: %s", name, e)
                score, error = 0.0, f"{type(e).__name__}: {e}"
            if not error:
                cache[name] = {
                    "fingerprint": fp,
                    "score": score,
                    "full_name": full_name,
                    "driver": driver,
                    "measured_at": time.time(),
                }
                dirty = True
        kind = name.split(".", 1)[0].upper()
        infos.append(DeviceInfo(name, kind, full_name, driver, score, error))
    if dirty:
        try:
            _write_cache(path, cache)
        except OSError as e:
            log.warning("could not write capacity cache %s: %s", path, e)
    best = max(infos, key=lambda d: d.score, default=None)
    vm = psutil.virtual_memory()
    return Capacity(
        devices=tuple(infos),
        mem_total=int(vm.total),
        mem_free=int(vm.available),
        cpu_count=usable_cpus(),
        speed_score=best.score if best else 0.0,
        best_device=best.name if best else "",
    )
