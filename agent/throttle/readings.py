"""What the probes read, at one moment (None: this platform cannot say)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Readings:
    idle_s: float | None = None  # seconds since the user's last keyboard or mouse input
    temp_c: float | None = None  # the hottest processor or chassis zone
    on_battery: bool | None = None
    battery_pct: float | None = None
    foreground_cpu: float | None = None  # other programs' share of all cores, 0..1
    foreground_gpu: float | None = None  # other programs' share of the busiest GPU engine, 0..1
    lid_closed: bool | None = None
    locked: bool | None = None  # the screen is locked (its user is away)

    def brief(self) -> dict[str, float | bool | None]:
        """For status APIs: the readings, rounded."""
        return {
            "idle_s": None if self.idle_s is None else round(self.idle_s, 1),
            "temp_c": None if self.temp_c is None else round(self.temp_c, 1),
            "on_battery": self.on_battery,
            "battery_pct": None if self.battery_pct is None else round(self.battery_pct),
            "foreground_cpu": None if self.foreground_cpu is None else round(self.foreground_cpu, 3),
            "foreground_gpu": None if self.foreground_gpu is None else round(self.foreground_gpu, 3),
            "lid_closed": self.lid_closed,
            "locked": self.locked,
        }
