"""The ``throttle`` section of ``config.yaml``, checked key by key::

throttle:
  idle_minutes: 2          # no input for this long before contributing fully again
  while_in_use: pause      # what the user's input does: pause, limit or run
  temp_high_c: 90          # at or above: paused ...
  temp_low_c: 80           # ... until at or below this
  on_battery: pause        # pause, limit or run
  battery_floor_pct: 30    # below this charge: paused whatever on_battery says
  cpu_high_pct: 60         # other programs using this much of all cores: limited (off: never) ...
  cpu_low_pct: 30          # ... until at or below this
  gpu_high_pct: 50         # other programs keeping a GPU engine this busy: limited (off: never) ...
  gpu_low_pct: 20          # ... until at or below this
  hours: "08:00-19:00"     # contribute only in these hours (may wrap midnight) ...
  days: [mon, tue, wed, thu, fri]   # ... on these days
  limited_share: 0.5       # what a limited node offers of its speed (threads at its next stage)
  min_dwell_s: 10          # a state lasts this long at least before a less restrictive one
  enabled: true
"""

from __future__ import annotations

import re
from typing import Any

from agent.throttle.policy import ALL_DAYS, MODES, ThrottleSettings

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
HOURS_RE = re.compile(r"^([01]?\d|2[0-4]):([0-5]\d)\s*-\s*([01]?\d|2[0-4]):([0-5]\d)$")
KNOWN = {
    "enabled",
    "idle_minutes",
    "while_in_use",
    "temp_high_c",
    "temp_low_c",
    "on_battery",
    "battery_floor_pct",
    "cpu_high_pct",
    "cpu_low_pct",
    "gpu_high_pct",
    "gpu_low_pct",
    "hours",
    "days",
    "limited_share",
    "min_dwell_s",
}


class ThrottleSettingsError(ValueError):
    """A bad value under ``throttle``; the message names the key."""


def _num(d: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise ThrottleSettingsError(f"throttle.{key}: {v!r} must be a number from {lo:g} to {hi:g}")
    return float(v)


def _high_mark(d: dict[str, Any], key: str, default: float) -> float | None:
    """A load's high mark in percent, or None for ``off`` (``false``); 0 is out of range, not off."""
    v = d.get(key)
    return None if v == "off" or v is False else _num(d, key, default, 1, 100)


def _mode(d: dict[str, Any], key: str, default: str) -> str:
    v = d.get(key, default)
    if v not in MODES:
        raise ThrottleSettingsError(f"throttle.{key}: {v!r} must be one of {', '.join(MODES)}")
    return str(v)


def parse_hours(v: Any) -> tuple[int, int] | None:
    """ "08:00-19:00" -> minutes (480, 1140); "22:00-06:00" wraps midnight."""
    if v is None:
        return None
    m = HOURS_RE.match(v.strip()) if isinstance(v, str) else None
    if m is None:
        raise ThrottleSettingsError(f"throttle.hours: {v!r} must look like 08:00-19:00")
    a = int(m.group(1)) * 60 + int(m.group(2))
    b = int(m.group(3)) * 60 + int(m.group(4))
    if a > 1440 or b > 1440 or a == b:
        raise ThrottleSettingsError(f"throttle.hours: {v!r} is not a span of the day")
    return a, b


def format_hours(hours: tuple[int, int] | None) -> str | None:
    """(480, 1140) -> "08:00-19:00" (``parse_hours`` read back)."""
    if hours is None:
        return None
    a, b = hours
    return f"{a // 60:02d}:{a % 60:02d}-{b // 60:02d}:{b % 60:02d}"


def throttle_mapping(t: ThrottleSettings) -> dict[str, Any]:
    """The ``throttle`` section that gives ``t`` (every key, defaults included): ``parse_throttle``
    read back, for showing the settings an agent runs with."""
    return {
        "enabled": t.enabled,
        "idle_minutes": t.idle_minutes,
        "while_in_use": t.while_in_use,
        "temp_high_c": t.temp_high_c,
        "temp_low_c": t.temp_low_c,
        "on_battery": t.on_battery,
        "battery_floor_pct": t.battery_floor_pct,
        "cpu_high_pct": "off" if t.cpu_high is None else round(t.cpu_high * 100, 6),
        "cpu_low_pct": round(t.cpu_low * 100, 6),
        "gpu_high_pct": "off" if t.gpu_high is None else round(t.gpu_high * 100, 6),
        "gpu_low_pct": round(t.gpu_low * 100, 6),
        "hours": format_hours(t.hours),
        "days": [DAYS[d] for d in sorted(t.days)],
        "limited_share": t.limited_share,
        "min_dwell_s": t.min_dwell_s,
    }


def parse_days(v: Any) -> frozenset[int]:
    if v is None:
        return ALL_DAYS
    if not isinstance(v, list) or not v or not all(isinstance(x, str) and x.lower()[:3] in DAYS for x in v):
        raise ThrottleSettingsError(f"throttle.days: {v!r} must be a list of days like [mon, tue]")
    return frozenset(DAYS.index(x.lower()[:3]) for x in v)


def parse_throttle(d: Any) -> ThrottleSettings:
    if d is None:
        return ThrottleSettings()
    if not isinstance(d, dict):
        raise ThrottleSettingsError("throttle: must be a mapping")
    unknown = set(d) - KNOWN
    if unknown:
        raise ThrottleSettingsError(f"throttle: unknown setting(s): {', '.join(sorted(map(str, unknown)))}")
    enabled = d.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ThrottleSettingsError("throttle.enabled: must be true or false")
    high, low = _num(d, "temp_high_c", 90, 30, 130), _num(d, "temp_low_c", 80, 20, 130)
    if low >= high:
        raise ThrottleSettingsError(f"throttle.temp_low_c: {low:g} must be below temp_high_c ({high:g})")
    cpu_high = _high_mark(d, "cpu_high_pct", 60)
    cpu_low = _num(d, "cpu_low_pct", 30, 0, 100)
    if cpu_high is not None and cpu_low >= cpu_high:
        raise ThrottleSettingsError(f"throttle.cpu_low_pct: {cpu_low:g} must be below cpu_high_pct ({cpu_high:g})")
    gpu_high = _high_mark(d, "gpu_high_pct", 50)
    gpu_low = _num(d, "gpu_low_pct", 20, 0, 100)
    if gpu_high is not None and gpu_low >= gpu_high:
        raise ThrottleSettingsError(f"throttle.gpu_low_pct: {gpu_low:g} must be below gpu_high_pct ({gpu_high:g})")
    return ThrottleSettings(
        enabled=enabled,
        idle_minutes=_num(d, "idle_minutes", 2, 0, 24 * 60),
        while_in_use=_mode(d, "while_in_use", "pause"),
        temp_high_c=high,
        temp_low_c=low,
        on_battery=_mode(d, "on_battery", "pause"),
        battery_floor_pct=_num(d, "battery_floor_pct", 30, 0, 100),
        cpu_high=None if cpu_high is None else cpu_high / 100,
        cpu_low=cpu_low / 100,
        gpu_high=None if gpu_high is None else gpu_high / 100,
        gpu_low=gpu_low / 100,
        hours=parse_hours(d.get("hours")),
        days=parse_days(d.get("days")),
        limited_share=_num(d, "limited_share", 0.5, 0.05, 1.0),
        min_dwell_s=_num(d, "min_dwell_s", 10, 0, 3600),
    )
