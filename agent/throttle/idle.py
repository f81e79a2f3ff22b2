"""Seconds since the user's last keyboard or mouse input, per platform (None: cannot say).

* Windows: ``GetLastInputInfo`` against ``GetTickCount`` (both 32-bit milliseconds, which wrap
  every 49.7 days: the difference is taken modulo 2**32).
* Linux X11: the MIT-SCREEN-SAVER extension (``XScreenSaverQueryInfo``, libXss) on ``$DISPLAY``.
* GNOME / Wayland: Mutter's ``org.gnome.Mutter.IdleMonitor`` over D-Bus (``gdbus``).
* Any systemd desktop: logind's ``IdleHint`` for the session (idle or not, no duration).
* macOS: ``HIDIdleTime`` of ``IOHIDSystem`` (``ioreg``).

Probes never raise; a failed one is remembered and not tried again for a while.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any

WRAP = 2**32
MUTTER_EVERY_S = 0.5  # a D-Bus call is a process: not every poll
HINT_IDLE_S = 86400.0  # logind says only "idle": as long idle as it gets


def windows_idle_ms(now_tick: int, last_input_tick: int) -> int:
    """Milliseconds since the last input from two 32-bit tick counts (pure; wraps every 49.7 days)."""
    return (now_tick - last_input_tick) % WRAP


class _LastInputInfo(ctypes.Structure):
    _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]


def _windows() -> float | None:
    windll: Any = getattr(ctypes, "windll", None)
    if windll is None:
        return None
    info = _LastInputInfo()
    info.cbSize = ctypes.sizeof(info)
    if not windll.user32.GetLastInputInfo(ctypes.byref(info)):
        return None
    now = windll.kernel32.GetTickCount() & (WRAP - 1)
    return windows_idle_ms(now, info.dwTime) / 1000.0


class _XssInfo(ctypes.Structure):
    _fields_ = [
        ("window", ctypes.c_ulong),
        ("state", ctypes.c_int),
        ("kind", ctypes.c_int),
        ("til_or_since", ctypes.c_ulong),
        ("idle", ctypes.c_ulong),
        ("eventMask", ctypes.c_ulong),
    ]


class X11Idle:
    """The X server's idle counter, through a display connection kept open."""

    def __init__(self, display: str) -> None:
        x11_name, xss_name = ctypes.util.find_library("X11"), ctypes.util.find_library("Xss")
        if not x11_name or not xss_name:
            raise OSError("libX11 or libXss is not installed")
        self.x11, self.xss = ctypes.CDLL(x11_name), ctypes.CDLL(xss_name)
        self.x11.XOpenDisplay.restype = ctypes.c_void_p
        self.x11.XOpenDisplay.argtypes = [ctypes.c_char_p]
        self.x11.XDefaultRootWindow.restype = ctypes.c_ulong
        self.x11.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
        self.xss.XScreenSaverQueryExtension.argtypes = [
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_int),
        ]
        self.xss.XScreenSaverAllocInfo.restype = ctypes.POINTER(_XssInfo)
        self.xss.XScreenSaverQueryInfo.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(_XssInfo)]
        self.display = self.x11.XOpenDisplay(display.encode())
        if not self.display:
            raise OSError(f"cannot open X display {display!r}")
        ev, err = ctypes.c_int(), ctypes.c_int()
        if not self.xss.XScreenSaverQueryExtension(self.display, ctypes.byref(ev), ctypes.byref(err)):
            raise OSError("the X server has no MIT-SCREEN-SAVER extension")
        self.info = self.xss.XScreenSaverAllocInfo()
        self.root = self.x11.XDefaultRootWindow(self.display)

    def read(self) -> float | None:
        if not self.xss.XScreenSaverQueryInfo(self.display, self.root, self.info):
            return None
        return float(self.info.contents.idle) / 1000.0


def parse_mutter(out: str) -> float | None:
    """``gdbus`` prints ``(uint64 1234,)``: milliseconds idle."""
    m = re.search(r"uint64 (\d+)", out)
    return int(m.group(1)) / 1000.0 if m else None


def parse_ioreg(out: str) -> float | None:
    """``ioreg -c IOHIDSystem``: ``"HIDIdleTime" = 1234567890`` in nanoseconds."""
    m = re.search(r'"HIDIdleTime"\s*=\s*(\d+)', out)
    return int(m.group(1)) / 1e9 if m else None


def _run(cmd: list[str], timeout: float = 2.0) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


class IdleProbe:
    """The first source that works on this machine, checked again now and then."""

    def __init__(self) -> None:
        self._x11: X11Idle | None = None
        self._x11_failed_at = float("-inf")
        self._mutter_at = float("-inf")
        self._mutter_last: float | None = None
        self._mutter_ok = shutil.which("gdbus") is not None
        self._hint_seen_idle = False
        self.source = "none"

    def read(self) -> float | None:
        try:
            return self._read()
        except Exception:
            return None

    def _read(self) -> float | None:
        if sys.platform == "win32":
            self.source = "GetLastInputInfo"
            return _windows()
        if sys.platform == "darwin":
            self.source = "HIDIdleTime"
            out = _run(["ioreg", "-c", "IOHIDSystem", "-d", "4"])
            return parse_ioreg(out) if out else None
        v = self._x11_read()
        if v is not None:
            self.source = "XScreenSaver"
            return v
        v = self._mutter_read()
        if v is not None:
            self.source = "Mutter IdleMonitor"
            return v
        hint = logind_idle_hint()
        if hint is not None:
            self._hint_seen_idle = self._hint_seen_idle or hint
            if hint:
                self.source = "logind IdleHint"
                return HINT_IDLE_S
            if self._hint_seen_idle:  # the session maintains its hint: not idle means in use
                self.source = "logind IdleHint"
                return 0.0
        return None

    def _x11_read(self) -> float | None:
        display = os.environ.get("DISPLAY")
        if not display:
            return None
        now = time.monotonic()
        if self._x11 is None:
            if now - self._x11_failed_at < 30.0:
                return None
            try:
                self._x11 = X11Idle(display)
            except OSError:
                self._x11_failed_at = now
                return None
        return self._x11.read()

    def _mutter_read(self) -> float | None:
        if not self._mutter_ok or not os.environ.get("DBUS_SESSION_BUS_ADDRESS"):
            return None
        now = time.monotonic()
        if now - self._mutter_at < MUTTER_EVERY_S:
            if self._mutter_last is None:
                return None
            return self._mutter_last + (now - self._mutter_at)  # extrapolated between two calls
        self._mutter_at = now
        out = _run(
            [
                "gdbus",
                "call",
                "--session",
                "--dest",
                "org.gnome.Mutter.IdleMonitor",
                "--object-path",
                "/org/gnome/Mutter/IdleMonitor/Core",
                "--method",
                "org.gnome.Mutter.IdleMonitor.GetIdletime",
            ],
            timeout=1.0,
        )
        self._mutter_last = parse_mutter(out) if out else None
        if out is None:
            self._mutter_ok = False  # no Mutter here: stop asking
        return self._mutter_last


def logind_idle_hint() -> bool | None:
    """logind's IdleHint for this session (True: idle), where systemd runs the session."""
    sid = os.environ.get("XDG_SESSION_ID")
    if not sid or shutil.which("loginctl") is None:
        return None
    out = _run(["loginctl", "show-session", sid, "-p", "IdleHint", "--value"], timeout=1.0)
    with contextlib.suppress(AttributeError):
        v = out.strip() if out else ""
        return {"yes": True, "no": False}.get(v)
    return None
