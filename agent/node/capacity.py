"""This machine's capacity probe: OpenVINO devices, a cached per-device speed score, and fresh memory figures.

Speed scores come from a short MatMul micro-benchmark (GFLOP/s) and are cached per device under a fingerprint
of the hardware, driver and OpenVINO version, so they are re-measured only when one of those changes.

Each device a stage can run on (the CPU and the GPUs: stage IRs are dynamic-shaped, which the NPU does
not run as-is) is offered with its own memory figure: a discrete GPU its own memory, everything else
(the CPU, an integrated GPU, which shares the system's RAM) the system's available memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import psutil
from openvino import opset13 as ops

from agent.common import paths
from agent.protocol.control import DeviceOffer
from agent.runtime.device import DeviceError, pick_device
from agent.runtime.kv_budget import kv_pool_bytes

log = logging.getLogger(__name__)

CACHE_VERSION = 1
_DRIVER_PROPS = ("DRIVER_VERSION", "GPU_DRIVER_VERSION", "NPU_DRIVER_VERSION")
_BATCH, _WIDTH, _LAYERS = 8, 1024, 4
STAGE_KINDS = ("CPU", "GPU")  # what AUTO offers: devices that run dynamic-shaped stage IRs


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    kind: str
    full_name: str
    driver: str
    score: float
    error: str = ""
    mem_total: int = 0
    mem_free: int = 0
    own_memory: bool = False  # a discrete GPU: its memory is its own, not the system's


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int
    own: bool


def device_memory(
    kind: str,
    device_type: str,
    total: int | None,
    stats: Mapping[str, Any] | None,
    system_total: int,
    system_free: int,
) -> DeviceMemory:
    """A device's memory from its OpenVINO properties (pure).

    A GPU whose ``DEVICE_TYPE`` reads as discrete has memory of its own: ``GPU_DEVICE_TOTAL_MEM_SIZE``
    less what ``GPU_MEMORY_STATISTICS`` counts as allocated (floored at 0); a discrete GPU that does
    not report its size offers nothing (0), rather than the system's RAM it cannot use. Everything
    else (the CPU, an integrated GPU) offers the system's memory.
    """
    if kind.upper() == "GPU" and device_type.strip().upper().endswith("DISCRETE"):
        if not total or total <= 0:
            return DeviceMemory(0, 0, True)
        used = sum(int(v) for v in (stats or {}).values() if isinstance(v, int | float) and not isinstance(v, bool))
        return DeviceMemory(int(total), max(0, int(total) - used), True)
    return DeviceMemory(system_total, system_free, False)


def _int_prop(core: ov.Core, device: str, name: str) -> int | None:
    try:
        v = core.get_property(device, name)
    except Exception:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _stats_prop(core: ov.Core, device: str) -> dict[str, Any]:
    try:
        v = core.get_property(device, "GPU_MEMORY_STATISTICS")
    except Exception:
        return {}
    return dict(v) if isinstance(v, Mapping) else {}


def query_memory(core: ov.Core, device: str) -> DeviceMemory:
    """:func:`device_memory` from ``core``'s properties of ``device``, read now (missing ones tolerated)."""
    vm = psutil.virtual_memory()
    kind = device.split(".", 1)[0].upper()
    if kind != "GPU":
        return DeviceMemory(int(vm.total), int(vm.available), False)
    dtype = _prop(core, device, "DEVICE_TYPE")
    own = dtype.upper().endswith("DISCRETE")
    return device_memory(
        kind,
        dtype,
        _int_prop(core, device, "GPU_DEVICE_TOTAL_MEM_SIZE") if own else None,
        _stats_prop(core, device) if own else None,
        int(vm.total),
        int(vm.available),
    )


def offered_devices(requested: str, available: Sequence[str]) -> list[str]:
    """The devices this agent offers (pure): for AUTO every CPU and GPU OpenVINO lists (not the
    NPU: stage IRs are dynamic-shaped); for a pinned device (``CPU``, ``GPU``, ``GPU.1``) only that
    one, as :func:`agent.runtime.device.pick_device` names it. Raises DeviceError if it is absent."""
    req = (requested or "AUTO").strip().upper()
    if req == "AUTO":
        return [d for d in available if d.split(".", 1)[0].upper() in STAGE_KINDS]
    return [pick_device(req, list(available))]


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
        d["kv_pool"] = kv_pool_bytes(self.mem_free)  # what a paged stage here would give its KV blocks now
        return d

    def offers(self) -> tuple[DeviceOffer, ...]:
        """What this node offers the planner, one entry per device that measured without error."""
        return tuple(
            DeviceOffer(d.name, round(d.score, 3), d.mem_free, d.own_memory)
            for d in self.devices
            if not d.error and d.score > 0
        )


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
    requested: str = "AUTO",
) -> Capacity:
    """Describe this machine. Speed scores are reused from the cache when the device fingerprint matches.

    ``requested`` is the agent's --device: AUTO measures every device a stage can run on, a pinned
    device only that one (a device that is not there: none). ``devices`` names them outright (tests).
    """
    path = cache_file if cache_file is not None else paths.cache_dir() / "capacity.json"
    core = ov.Core()
    if devices is not None:
        names = list(devices)
    else:
        try:
            names = offered_devices(requested, list(core.available_devices))
        except DeviceError as e:
            log.warning("nothing to offer: %s", e)
            names = []
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
        mem = query_memory(core, name)
        infos.append(DeviceInfo(name, kind, full_name, driver, score, error, mem.total, mem.free, mem.own))
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
