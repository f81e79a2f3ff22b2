"""Capacity probe: real OpenVINO CPU benchmark, fingerprinted score cache."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from agent.node.capacity import Capacity, DeviceMemory, device_memory, fingerprint, offered_devices, probe
from agent.protocol import DeviceOffer
from agent.runtime.device import DeviceError

BENCH = 0.05


def _probe(cache: Path, *, refresh: bool = False) -> Capacity:
    return probe(cache, refresh=refresh, bench_seconds=BENCH, devices=["CPU"])


def _cpu_entry(cache: Path) -> dict[str, object]:
    entry: dict[str, object] = json.loads(cache.read_text())["devices"]["CPU"]
    return entry


def test_probe_cpu(tmp_path: Path) -> None:
    cap = _probe(tmp_path / "capacity.json")
    (cpu,) = cap.devices
    assert cpu.name == "CPU" and cpu.kind == "CPU" and cpu.error == ""
    assert cpu.full_name
    assert cpu.score > 0
    assert cap.mem_total >= cap.mem_free > 0
    assert cpu.mem_total == cap.mem_total and cpu.mem_free > 0 and not cpu.own_memory  # the system's RAM
    assert cap.offers() == (DeviceOffer("CPU", round(cpu.score, 3), cpu.mem_free, False),)
    assert cap.cpu_count >= 1
    assert cap.best_device == "CPU"
    assert cap.speed_score == max(d.score for d in cap.devices) == cpu.score
    assert cap.kinds() == ["CPU"]
    d = json.loads(json.dumps(cap.to_dict()))
    assert d["devices"][0]["name"] == "CPU" and d["best_device"] == "CPU"
    assert _cpu_entry(tmp_path / "capacity.json")["fingerprint"] == fingerprint("CPU", cpu.full_name, cpu.driver)


def test_cache_reused(tmp_path: Path) -> None:
    cache = tmp_path / "capacity.json"
    first = _probe(cache)
    mtime = cache.stat().st_mtime_ns
    second = _probe(cache)
    assert second.speed_score == first.speed_score
    assert cache.stat().st_mtime_ns == mtime
    # A planted score under the current fingerprint is returned verbatim: no benchmark ran.
    data = json.loads(cache.read_text())
    data["devices"]["CPU"]["score"] = 12345.5
    cache.write_text(json.dumps(data))
    assert _probe(cache).devices[0].score == 12345.5


def test_changed_fingerprint_remeasures(tmp_path: Path) -> None:
    cache = tmp_path / "capacity.json"
    cur = _probe(cache).devices[0]
    data = json.loads(cache.read_text())
    data["devices"]["CPU"].update(fingerprint="0" * 64, score=12345.5)
    cache.write_text(json.dumps(data))
    cap = _probe(cache)
    assert cap.devices[0].score != 12345.5 and cap.devices[0].score > 0
    entry = _cpu_entry(cache)
    assert entry["fingerprint"] == fingerprint("CPU", cur.full_name, cur.driver)
    assert entry["score"] == cap.devices[0].score


def test_corrupt_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "capacity.json"
    cache.write_bytes(b"\x00\xff garbage {{{")
    with caplog.at_level(logging.WARNING, logger="agent.node.capacity"):
        cap = _probe(cache)
    assert "corrupt" in caplog.text
    assert cap.devices[0].score > 0
    assert _cpu_entry(cache)["score"] == cap.devices[0].score


def test_refresh_remeasures(tmp_path: Path) -> None:
    cache = tmp_path / "capacity.json"
    _probe(cache)
    data = json.loads(cache.read_text())
    data["devices"]["CPU"]["score"] = 12345.5
    cache.write_text(json.dumps(data))
    cap = _probe(cache, refresh=True)
    assert cap.devices[0].score != 12345.5 and cap.devices[0].score > 0
    assert _cpu_entry(cache)["score"] == cap.devices[0].score


def test_bad_device_does_not_stop_probe(tmp_path: Path) -> None:
    cap = probe(tmp_path / "capacity.json", bench_seconds=BENCH, devices=["NOPE", "CPU"])
    bad, cpu = cap.devices
    assert bad.score == 0.0 and bad.error and bad.kind == "NOPE"
    assert cpu.score > 0 and cap.best_device == "CPU"


def test_probe_offers_the_requested_device_only(tmp_path: Path) -> None:
    cache = tmp_path / "capacity.json"
    cap = probe(cache, bench_seconds=BENCH, requested="CPU")
    assert [d.name for d in cap.devices] == ["CPU"] and cap.best_device == "CPU"
    # pinned to a device this machine lacks: nothing is offered (the stage would not run there)
    if "GPU" not in cap.kinds():
        gone = probe(cache, bench_seconds=BENCH, requested="GPU")
        assert gone.devices == () and gone.offers() == () and gone.speed_score == 0.0
    auto = probe(cache, bench_seconds=BENCH)
    assert {d.kind for d in auto.devices} <= {"CPU", "GPU"} and "CPU" in auto.kinds()


@pytest.mark.parametrize(
    ("requested", "available", "offered"),
    [
        ("AUTO", ["CPU"], ["CPU"]),
        ("AUTO", ["CPU", "GPU"], ["CPU", "GPU"]),
        ("auto", ["CPU", "GPU.0", "GPU.1", "NPU"], ["CPU", "GPU.0", "GPU.1"]),  # no NPU: stages are dynamic-shaped
        ("", ["CPU", "NPU"], ["CPU"]),
        ("CPU", ["CPU", "GPU"], ["CPU"]),  # pinned: that device only (not the faster GPU)
        ("GPU", ["CPU", "GPU"], ["GPU"]),
        ("GPU", ["CPU", "GPU.0", "GPU.1"], ["GPU"]),
        ("GPU.1", ["CPU", "GPU.0", "GPU.1"], ["GPU.1"]),
        ("NPU", ["CPU", "NPU"], ["NPU"]),  # asked for explicitly
    ],
)
def test_offered_devices(requested: str, available: list[str], offered: list[str]) -> None:
    assert offered_devices(requested, available) == offered


def test_a_pinned_device_not_there_offers_nothing_but_says_why() -> None:
    with pytest.raises(DeviceError, match="OpenVINO sees: CPU"):
        offered_devices("GPU", ["CPU"])


GIB = 1024**3
SYS = (32 * GIB, 20 * GIB)  # system total, available


@pytest.mark.parametrize(
    ("kind", "device_type", "total", "stats", "want"),
    [
        # a discrete GPU: its own memory less what is allocated on it
        (
            "GPU",
            "Type.DISCRETE",
            16 * GIB,
            {"usm_device": 3 * GIB, "cl_mem": GIB},
            DeviceMemory(16 * GIB, 12 * GIB, True),
        ),
        ("GPU", "DISCRETE", 8 * GIB, {}, DeviceMemory(8 * GIB, 8 * GIB, True)),
        ("GPU", "Type.DISCRETE", 8 * GIB, None, DeviceMemory(8 * GIB, 8 * GIB, True)),
        ("GPU", "Type.DISCRETE", 4 * GIB, {"usm_device": 6 * GIB}, DeviceMemory(4 * GIB, 0, True)),  # floored at 0
        ("GPU", "Type.DISCRETE", 8 * GIB, {"usm_device": GIB, "odd": "n/a"}, DeviceMemory(8 * GIB, 7 * GIB, True)),
        # a discrete GPU that does not say its size offers no memory (not the system's RAM)
        ("GPU", "Type.DISCRETE", None, None, DeviceMemory(0, 0, True)),
        # an integrated GPU shares the system's RAM; so does the CPU
        ("GPU", "Type.INTEGRATED", 16 * GIB, {"usm_host": GIB}, DeviceMemory(*SYS, False)),
        ("GPU", "", None, None, DeviceMemory(*SYS, False)),
        ("CPU", "Type.INTEGRATED", None, None, DeviceMemory(*SYS, False)),
        ("CPU", "Type.DISCRETE", 8 * GIB, None, DeviceMemory(*SYS, False)),  # only a GPU has memory of its own
    ],
)
def test_device_memory(
    kind: str, device_type: str, total: int | None, stats: dict[str, object] | None, want: DeviceMemory
) -> None:
    assert device_memory(kind, device_type, total, stats, *SYS) == want
