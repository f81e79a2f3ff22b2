"""Capacity probe: real OpenVINO CPU benchmark, fingerprinted score cache."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from agent.capacity import Capacity, fingerprint, probe

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
    with caplog.at_level(logging.WARNING, logger="agent.capacity"):
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
