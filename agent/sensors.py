"""Readings of this laptop that node maps show: the chassis temperature (None where unknown).

Never raises: a platform that cannot say gives None.
"""

from __future__ import annotations

import psutil

# zones that measure the processor package or the chassis, best first
ZONES = ("coretemp", "k10temp", "x86_pkg_temp", "cpu_thermal", "acpitz", "zenpower")


def temperature_c() -> float | None:
    """The hottest reading of the processor's (or failing that, any) thermal zone, in Celsius."""
    read = getattr(psutil, "sensors_temperatures", None)
    if read is None:
        return None
    try:
        zones = read() or {}
    except Exception:
        return None
    for name in (*ZONES, *zones):
        temps = [t.current for t in zones.get(name, []) if t.current is not None and -50 < t.current < 200]
        if temps:
            return float(max(temps))
    return None
