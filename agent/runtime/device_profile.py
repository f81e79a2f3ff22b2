"""How a stage is compiled on each kind of device: everything that differs between CPU and GPU.

One IR serves every device (a plan may move a stage between a GPU and CPU cores without a new
export): INT4/INT8 weights are compressed constants that the CPU plugin and the GPU plugin each
decompress in their own fused MatMul kernels, so the weights path needs no per-device export.
What differs is how the compiled model computes, and that is chosen here from what the device
reports (``OPTIMIZATION_CAPABILITIES``, ``DEVICE_TYPE``), not from its name:

============================  ===============================  ==================================
property                      CPU                              GPU
============================  ===============================  ==================================
activations                   f32 (bf16 loses on a one-token   f16 where the device has FP16,
(INFERENCE_PRECISION_HINT)    step; ``LAKESHARD_CPU_PRECI-     else f32 (the lent H200 through
                              SION`` overrides)                PoCL reports no FP16)
KV cache                      f32 (f16 made a token's logits   f16 where FP16, else f32
(KV_CACHE_PRECISION;          depend on how many tokens share
``LAKESHARD_KV_PRECISION``    its infer call by up to 0.02, so
overrides: f32, f16, u8)      batch companions, drafts and
                              prompt chunks changed greedy
                              text; f32 leaves 6e-5 and cost
                              no measurable speed: see
                              docs/bench/reproducibility.md)
dynamic quantization of       plugin default                   plugin default (it quantizes
activations (DYNAMIC_QUANTI-                                   only on XMX devices:
ZATION_GROUP_SIZE)                                             GPU_HW_MATMUL)
exact mode (parity tests)     f32, f32 KV, no dynamic          the same
                              quantization
threads                       INFERENCE_NUM_THREADS            not a GPU property
compiled-model cache          ``CACHE_DIR`` on the Core (GPU kernels take seconds to build)
streams of one stage          one InferRequest each, on one    one compiled model each (measured
(``model_per_stream``)        compiled model                   on the GPU plugin through PoCL:
                                                               requests of one stateful compiled
                                                               model stepped in turn change each
                                                               other's tokens; a model each is
                                                               exact; the weights are loaded once
                                                               a stream)
============================  ===============================  ==================================

``properties_for`` is the pure table; ``compile_properties`` asks OpenVINO for the device's
traits and drops any key the device does not support, so an older plugin or an NPU gets only
what it understands.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from functools import cache
from typing import Any

from agent.runtime.device import DeviceError, core

log = logging.getLogger(__name__)
KV_PRECISIONS = ("f32", "f16", "u8")


def model_per_stream(device: str) -> bool:
    """Whether each stream of a stage needs a compiled model of its own (see the table)."""
    return device.split(".")[0] == "GPU"


@dataclass(frozen=True)
class DeviceTraits:
    """What a device reports about itself, as far as compiling a stage is concerned."""

    kind: str  # CPU, GPU, NPU
    caps: frozenset[str]  # OPTIMIZATION_CAPABILITIES
    integrated: bool = True  # shares the host's memory (CPU, iGPU); a dGPU has its own

    @property
    def fp16(self) -> bool:
        return "FP16" in self.caps

    @property
    def xmx(self) -> bool:
        """Matrix engines (Intel XMX): where the GPU plugin's dynamic quantization pays."""
        return "GPU_HW_MATMUL" in self.caps


def properties_for(
    t: DeviceTraits,
    *,
    threads: int | None = None,
    exact: bool = False,
    kv_precision: str | None = None,
    cpu_precision: str = "f32",
) -> dict[str, Any]:
    """Compile properties of a stage on a device with traits ``t`` (pure; see the module's table).

    ``exact`` = f32 everywhere and no dynamic quantization (a result must not depend on how
    many tokens share a call: prefill vs steps, verify vs decode), for parity tests.
    """
    if kv_precision is not None and kv_precision not in KV_PRECISIONS:
        raise DeviceError(f"LAKESHARD_KV_PRECISION must be one of {', '.join(KV_PRECISIONS)}, not {kv_precision!r}")
    props: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
    if exact:
        if t.kind in ("CPU", "GPU"):
            props["INFERENCE_PRECISION_HINT"] = "f32"
            props["KV_CACHE_PRECISION"] = "f32"
            props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
    elif t.kind == "CPU":
        if cpu_precision not in ("f32", "bf16", "f16"):
            raise DeviceError(f"LAKESHARD_CPU_PRECISION must be f32, bf16 or f16, not {cpu_precision!r}")
        props["INFERENCE_PRECISION_HINT"] = cpu_precision
        props["KV_CACHE_PRECISION"] = kv_precision or "f32"
    elif t.kind == "GPU":
        props["INFERENCE_PRECISION_HINT"] = "f16" if t.fp16 else "f32"
        props["KV_CACHE_PRECISION"] = kv_precision or ("f16" if t.fp16 else "f32")
    if t.kind == "CPU" and threads:
        props["INFERENCE_NUM_THREADS"] = int(threads)
    return props


def _text_list(v: Any) -> list[str]:
    if isinstance(v, str):
        return v.split()
    return [str(x) for x in v] if v is not None else []


@cache
def device_traits(device: str) -> DeviceTraits:
    """Ask OpenVINO what ``device`` reports (cached per process: it does not change)."""
    kind = device.split(".")[0].upper()
    c = core()
    try:
        caps = frozenset(_text_list(c.get_property(device, "OPTIMIZATION_CAPABILITIES")))
    except RuntimeError:
        caps = frozenset()
    integrated = True
    if kind == "GPU":
        with contextlib.suppress(RuntimeError):
            integrated = str(c.get_property(device, "DEVICE_TYPE")).lower().endswith("integrated")
    return DeviceTraits(kind, caps, integrated)


@cache
def _supported(device: str) -> frozenset[str]:
    try:
        return frozenset(str(p) for p in core().get_property(device, "SUPPORTED_PROPERTIES"))
    except RuntimeError:
        return frozenset()


def compile_properties(
    device: str, *, threads: int | None = None, exact: bool = False, kv_precision: str | None = None
) -> dict[str, Any]:
    """:func:`properties_for` this machine's ``device``, less what its plugin does not support."""
    props = properties_for(
        device_traits(device),
        threads=threads,
        exact=exact,
        kv_precision=kv_precision or os.environ.get("LAKESHARD_KV_PRECISION") or None,
        cpu_precision=os.environ.get("LAKESHARD_CPU_PRECISION", "f32"),
    )
    supported = _supported(device)
    if not supported:
        return props
    dropped = sorted(k for k in props if k not in supported)
    if dropped:
        log.debug("%s does not support %s: left at its defaults", device, ", ".join(dropped))
    return {k: v for k, v in props.items() if k in supported}
