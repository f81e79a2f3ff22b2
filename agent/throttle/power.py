"""Battery, lid and screen lock (None: this platform cannot say).

* battery: ``psutil.sensors_battery()`` (plugged in or not, charge); None on a desktop.
* lid: Linux ACPI (``/proc/acpi/button/lid/*/state``); elsewhere None (the OS suspends).
* screen lock: logind's ``LockedHint`` for this session (systemd desktops).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import psutil


def battery() -> tuple[bool | None, float | None]:
    """(on battery, percent charged)."""
    read = getattr(psutil, "sensors_battery", None)
    try:
        b = read() if read is not None else None
    except Exception:
        return None, None
    if b is None:
        return None, None
    on_battery = None if b.power_plugged is None else not b.power_plugged
    pct = float(b.percent) if b.percent is not None else None
    return on_battery, pct


def lid_closed(root: Path = Path("/proc/acpi/button/lid")) -> bool | None:
    """Whether any lid reports "closed" (Linux ACPI)."""
    try:
        states = [p.read_text() for p in root.glob("*/state")]
    except OSError:
        return None
    if not states:
        return None
    return any("closed" in s for s in states)


def screen_locked() -> bool | None:
    sid = os.environ.get("XDG_SESSION_ID")
    if not sid or shutil.which("loginctl") is None:
        return None
    try:
        r = subprocess.run(
            ["loginctl", "show-session", sid, "-p", "LockedHint", "--value"], capture_output=True, text=True, timeout=1
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {"yes": True, "no": False}.get(r.stdout.strip())
