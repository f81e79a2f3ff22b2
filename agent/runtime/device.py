"""OpenVINO device choice and compile properties (GPU/NPU used when present, CPU otherwise)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import openvino as ov

from agent.common.paths import compiled_cache_dir

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


def pick_device(requested: str, available: list[str]) -> str:
    """The device a stage runs on, from what was asked for and what OpenVINO lists (pure).

    AUTO takes the first GPU (``GPU`` or ``GPU.0``: on a laptop, the integrated one), else
    the CPU. Stage IRs have dynamic shapes, which the NPU plugin does not run as-is: NPU is
    used only when asked for explicitly. A kind (``GPU``) matches any of its devices
    (``GPU.0``, ``GPU.1``); a device not listed is one line naming those that are.
    """
    req = (requested or "AUTO").strip().upper()
    if req == "AUTO":
        gpus = [d for d in available if d.split(".")[0] == "GPU"]
        return gpus[0] if gpus else "CPU"
    if req in available:
        return req
    same_kind = [d for d in available if d.split(".")[0] == req]
    if same_kind:
        return req if "." not in req else same_kind[0]
    seen = ", ".join(available) or "nothing"
    raise DeviceError(f"device {requested!r} is not available; OpenVINO sees: {seen}")


def same_device(a: str, b: str) -> bool:
    """Whether two device names mean the same device (pure): ``GPU`` is ``GPU.0``, case aside."""

    def norm(d: str) -> str:
        d = d.strip().upper()
        return d if "." in d else f"{d}.0"

    return norm(a) == norm(b)


def assigned_device(pinned: str, asked: str | None) -> str:
    """The device an assigned stage compiles on (pure): the assignment's, else the agent's own.

    An agent pinned to a device (``--device CPU``) takes no other: an assignment naming another
    raises DeviceError naming both.
    """
    own = (pinned or "AUTO").strip()
    if not asked:
        return own
    if own.upper() != "AUTO" and not same_device(own, asked):
        raise DeviceError(f"this agent is pinned to device {own}; the assignment asks for {asked}")
    return asked


def choose_device(requested: str = "AUTO") -> str:
    """:func:`pick_device` over the devices this machine's OpenVINO lists."""
    return pick_device(requested, available_devices())
