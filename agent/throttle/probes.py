"""All the probes together: one :class:`Readings` a call.

The idle time is read on every call (it is what must react within a second); temperature,
battery, lid, lock and foreground load (CPU and GPU) at most every ``slow_s``.
``LAKESHARD_FAKE_SENSORS`` names a JSON file whose keys (``idle_s``, ``temp_c``, ``on_battery``,
``battery_pct``, ``foreground_cpu``, ``foreground_gpu``, ``lid_closed``, ``locked``) stand in for
the hardware this machine lacks (a test's heat source, a battery); it is read again on every
call, and announced in the log.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from agent.throttle.gpu_load import GpuLoad
from agent.throttle.idle import IdleProbe
from agent.throttle.load import ForegroundLoad
from agent.throttle.power import battery, lid_closed, screen_locked
from agent.throttle.readings import Readings
from agent.throttle.thermal import temperature_c

log = logging.getLogger(__name__)
FAKE_ENV = "LAKESHARD_FAKE_SENSORS"
KEYS = {f.name for f in fields(Readings)}


def fake_readings(path: Path) -> dict[str, Any]:
    """The stand-in values in ``path`` (an unreadable or malformed file stands in for nothing)."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(d, dict):
        return {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        if k in ("on_battery", "lid_closed", "locked"):
            if isinstance(v, bool) or v is None:
                out[k] = v
        elif k in KEYS and (v is None or (isinstance(v, int | float) and not isinstance(v, bool))):
            out[k] = None if v is None else float(v)
    return out


class Probes:
    def __init__(self, slow_s: float = 1.0) -> None:
        self.slow_s = slow_s
        self.idle = IdleProbe()
        self.load = ForegroundLoad()
        self.gpu = GpuLoad()
        self._slow = Readings()
        self._slow_at = float("-inf")
        fake = os.environ.get(FAKE_ENV)
        self.fake = Path(fake) if fake else None
        if self.fake is not None:
            log.warning("sensor readings from %s stand in for this machine's (%s)", self.fake, FAKE_ENV)

    def read(self) -> Readings:
        now = time.monotonic()
        if now - self._slow_at >= self.slow_s:
            self._slow_at = now
            on_battery, pct = battery()
            self._slow = Readings(
                temp_c=temperature_c(),
                on_battery=on_battery,
                battery_pct=pct,
                foreground_cpu=self.load.read(),
                foreground_gpu=self.gpu.read(),
                lid_closed=lid_closed(),
                locked=screen_locked(),
            )
        r = replace(self._slow, idle_s=self.idle.read())
        if self.fake is not None:
            r = replace(r, **fake_readings(self.fake))
        return r

    def sources(self) -> dict[str, str]:
        return {"idle": self.idle.source, "fake": str(self.fake) if self.fake else ""}
