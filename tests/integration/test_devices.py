"""Which device a stage runs on, and how it is compiled there (pure tables; no GPU needed).

The traits below are what real devices report: the lent H200 through PoCL (no FP16), a Lunar
Lake Arc iGPU (FP16, XMX), and a CPU. The GPU path itself is exercised in ``test_gpu.py``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from agent.runtime.device import DeviceError, assigned_device, available_devices, pick_device, same_device
from agent.runtime.device_profile import DeviceTraits, compile_properties, properties_for

H200_POCL = DeviceTraits("GPU", frozenset({"FP32", "BIN", "INT8", "EXPORT_IMPORT"}), integrated=False)
ARC_IGPU = DeviceTraits("GPU", frozenset({"FP32", "BIN", "FP16", "INT8", "GPU_HW_MATMUL", "EXPORT_IMPORT"}))
XEON = DeviceTraits("CPU", frozenset({"FP32", "INT8", "BIN", "EXPORT_IMPORT"}))


@pytest.mark.parametrize(
    ("requested", "available", "picked"),
    [
        ("AUTO", ["CPU", "GPU"], "GPU"),
        ("AUTO", ["CPU", "GPU.0", "GPU.1"], "GPU.0"),  # an iGPU is GPU.0 beside a discrete one
        ("AUTO", ["CPU", "NPU"], "CPU"),  # dynamic-shape stages do not run on the NPU as-is
        ("AUTO", ["CPU"], "CPU"),
        ("", ["CPU", "GPU"], "GPU"),
        ("gpu", ["CPU", "GPU"], "GPU"),
        ("GPU", ["CPU", "GPU.0", "GPU.1"], "GPU"),
        ("GPU.1", ["CPU", "GPU.0", "GPU.1"], "GPU.1"),
        (" cpu ", ["CPU", "GPU"], "CPU"),
        ("NPU", ["CPU", "NPU"], "NPU"),
    ],
)
def test_pick_device(requested: str, available: list[str], picked: str) -> None:
    assert pick_device(requested, available) == picked


@pytest.mark.parametrize(
    ("requested", "available"),
    [("GPU", ["CPU"]), ("GPU.2", ["CPU", "GPU.0", "GPU.1"]), ("NPU", ["CPU", "GPU"]), ("TPU", [])],
)
def test_a_device_not_there_is_one_line_naming_those_seen(requested: str, available: list[str]) -> None:
    with pytest.raises(DeviceError) as e:
        pick_device(requested, available)
    msg = str(e.value)
    assert "\n" not in msg and repr(requested) in msg
    assert msg.endswith("OpenVINO sees: " + (", ".join(available) or "nothing"))


@pytest.mark.parametrize(
    ("pinned", "asked", "device"),
    [
        ("AUTO", None, "AUTO"),  # no device in the assignment: the agent's own choice
        ("CPU", None, "CPU"),
        ("AUTO", "GPU", "GPU"),  # an AUTO agent takes the planner's device
        ("AUTO", "CPU", "CPU"),
        ("auto", "GPU.1", "GPU.1"),
        ("CPU", "CPU", "CPU"),
        ("GPU", "GPU.0", "GPU.0"),  # GPU is GPU.0
        ("gpu.0", "GPU", "GPU"),
        ("CPU", "GPU", None),  # pinned: another device is refused
        ("GPU.1", "GPU", None),
        ("GPU", "CPU", None),
    ],
)
def test_assigned_device(pinned: str, asked: str | None, device: str | None) -> None:
    if device is not None:
        assert assigned_device(pinned, asked) == device
        return
    with pytest.raises(DeviceError) as e:
        assigned_device(pinned, asked)
    assert pinned in str(e.value) and str(asked) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("GPU", "GPU.0", True),
        ("gpu.1", "GPU.1", True),
        ("GPU", "GPU.1", False),
        ("CPU", "cpu", True),
        ("CPU", "GPU", False),
    ],
)
def test_same_device(a: str, b: str, same: bool) -> None:
    assert same_device(a, b) is same


@pytest.mark.parametrize(
    ("traits", "exact", "want"),
    [
        # a GPU without FP16 (the lent H200 through PoCL) computes and caches in f32
        (H200_POCL, False, {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}),
        # an Arc iGPU: f16 activations and KV; dynamic quantization left to the plugin (XMX)
        (ARC_IGPU, False, {"INFERENCE_PRECISION_HINT": "f16", "KV_CACHE_PRECISION": "f16"}),
        (XEON, False, {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}),
        # exact mode is f32 end to end with no dynamic quantization, whatever the device
        (
            ARC_IGPU,
            True,
            {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0},
        ),
        (
            XEON,
            True,
            {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0},
        ),
    ],
)
def test_compile_properties_follow_what_the_device_reports(
    traits: DeviceTraits, exact: bool, want: dict[str, object]
) -> None:
    props = properties_for(traits, exact=exact)
    assert props.pop("PERFORMANCE_HINT") == "LATENCY"
    assert props == want


def test_threads_go_to_the_cpu_only_and_kv_precision_can_be_asked_for() -> None:
    assert properties_for(XEON, threads=2)["INFERENCE_NUM_THREADS"] == 2
    assert "INFERENCE_NUM_THREADS" not in properties_for(ARC_IGPU, threads=2)
    assert properties_for(ARC_IGPU, kv_precision="u8")["KV_CACHE_PRECISION"] == "u8"
    assert properties_for(XEON, kv_precision="f16")["KV_CACHE_PRECISION"] == "f16"
    assert properties_for(XEON, cpu_precision="bf16")["INFERENCE_PRECISION_HINT"] == "bf16"
    with pytest.raises(DeviceError, match="LAKESHARD_KV_PRECISION"):
        properties_for(XEON, kv_precision="f8")
    with pytest.raises(DeviceError, match="LAKESHARD_CPU_PRECISION"):
        properties_for(XEON, cpu_precision="int3")


def test_this_machines_cpu_compiles_with_what_it_supports() -> None:
    props = compile_properties("CPU", threads=1)
    assert props["INFERENCE_NUM_THREADS"] == 1 and props["INFERENCE_PRECISION_HINT"] == "f32"


def test_asking_the_cli_for_a_missing_device_says_which_exist() -> None:
    if any(d.startswith("NPU") for d in available_devices()):
        pytest.skip("this machine has an NPU")
    r = subprocess.run(
        [sys.executable, "-m", "agent", "generate", "smollm2-135m", "--device", "NPU", "--prompt", "hello"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "'NPU' is not available; OpenVINO sees: " + ", ".join(available_devices()) in last
