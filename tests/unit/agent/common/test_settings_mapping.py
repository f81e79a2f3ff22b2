"""What an agent runs with, shown as a settings file (``GET /v1/settings``'s ``effective`` and
``from_file``): :func:`agent.common.config.to_mapping` reads back through ``parse`` to the same
settings, and the throttle section the same way."""

from __future__ import annotations

from typing import Any

import pytest

from agent.common.config import Settings, parse, to_mapping
from agent.throttle.settings import format_hours, parse_hours

FILES: list[dict[str, Any]] = [
    {},
    {"cluster_id": "office-3f", "name": "Alice's laptop", "port": 7710, "api_port": 0, "log_level": "info"},
    {"discovery": {"mdns": False, "static_peers": ["10.0.0.21:7700", "[fe80::1]:7700"]}},
    {"election": {"preferred": ["abc"], "exclude": ["d1", "c2"], "min_coordinator_memory_gb": 3.5}},
    {"serve": {"model": "smollm2-135m", "weights": "int8", "ring_port": 7800, "streams": 8, "attention": "paged"}},
    {"throttle": {"hours": "22:00-06:00", "days": ["mon", "fri"], "cpu_high_pct": "off", "while_in_use": "limit"}},
    {"throttle": {"enabled": False, "idle_minutes": 0.5, "gpu_high_pct": 70, "gpu_low_pct": 10}},
    {"models_dir": "/data/models", "insecure": True, "interface": "10.0.0.5"},
]


@pytest.mark.parametrize("file", FILES)
def test_settings_read_back_as_the_file_that_gives_them(file: dict[str, Any]) -> None:
    s = parse(file or None)
    m = to_mapping(s)
    assert parse(m) == s
    assert all(v is not None for v in m.values())  # what is not set is left out, as a file leaves it out


def test_every_setting_is_written_out() -> None:
    m = to_mapping(Settings())
    assert {"cluster_id", "port", "api_port", "discovery", "election", "log_level", "throttle", "serve"} <= set(m)
    assert m["throttle"]["while_in_use"] == "pause" and m["serve"]["api_port"] == 8000


@pytest.mark.parametrize("hours", ["08:00-19:00", "22:00-06:00", "00:00-24:00", "07:30-07:45"])
def test_hours_read_back(hours: str) -> None:
    assert format_hours(parse_hours(hours)) == hours
