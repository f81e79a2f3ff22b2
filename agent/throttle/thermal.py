"""The chassis temperature: the hottest processor (or failing that, any) thermal zone, in °C.

* Linux, and wherever psutil reads sensors: ``psutil.sensors_temperatures()`` (coretemp,
  k10temp, x86_pkg_temp, acpitz ... zones).
* Windows: the "Thermal Zone Information" performance counters (PDH), in kelvin.
* macOS reports a thermal pressure level, not a temperature: None.

Never raises: a platform that cannot say gives None.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import psutil

# zones that measure the processor package or the chassis, best first
ZONES = ("coretemp", "k10temp", "x86_pkg_temp", "cpu_thermal", "acpitz", "zenpower")


def hottest(zones: dict[str, list[Any]]) -> float | None:
    """The hottest plausible reading of the preferred zones, else of any zone (pure)."""
    for name in (*ZONES, *zones):
        temps = [t.current for t in zones.get(name, []) if t.current is not None and -50 < t.current < 200]
        if temps:
            return float(max(temps))
    return None


def temperature_c() -> float | None:
    if sys.platform == "win32":
        return _windows_pdh()
    read = getattr(psutil, "sensors_temperatures", None)
    if read is None:
        return None
    try:
        return hottest(read() or {})
    except Exception:
        return None


class _PdhValue(ctypes.Structure):
    _fields_ = [("CStatus", ctypes.c_ulong), ("doubleValue", ctypes.c_double)]


def _windows_pdh() -> float | None:
    """The hottest ACPI thermal zone from the performance counters (kelvin -> °C)."""
    try:
        pdh: Any = ctypes.windll.pdh  # type: ignore[attr-defined,unused-ignore]
        query, counter = ctypes.c_void_p(), ctypes.c_void_p()
        if pdh.PdhOpenQueryW(None, 0, ctypes.byref(query)) != 0:
            return None
        try:
            path = r"\Thermal Zone Information(*)\Temperature"
            if pdh.PdhAddEnglishCounterW(query, path, 0, ctypes.byref(counter)) != 0:
                return None
            if pdh.PdhCollectQueryData(query) != 0:
                return None
            size, count = ctypes.c_ulong(0), ctypes.c_ulong(0)
            fmt = 0x200  # PDH_FMT_DOUBLE
            pdh.PdhGetFormattedCounterArrayW(counter, fmt, ctypes.byref(size), ctypes.byref(count), None)
            buf = (ctypes.c_byte * size.value)()
            if pdh.PdhGetFormattedCounterArrayW(counter, fmt, ctypes.byref(size), ctypes.byref(count), buf) != 0:
                return None

            class Item(ctypes.Structure):
                _fields_ = [("name", ctypes.c_wchar_p), ("value", _PdhValue)]

            items = ctypes.cast(buf, ctypes.POINTER(Item))
            kelvin = [items[i].value.doubleValue for i in range(count.value) if items[i].value.CStatus == 0]
        finally:
            pdh.PdhCloseQuery(query)
    except Exception:
        return None
    temps = [k - 273.15 for k in kelvin if 200 < k < 470]
    return max(temps) if temps else None
