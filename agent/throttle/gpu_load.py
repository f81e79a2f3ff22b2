"""GPU foreground load: the laptop's other programs' share of its busiest GPU engine.

Since the previous reading, 0..1 (None: the first reading, or the OS cannot say; never raises):

* Linux: DRM fdinfo (i915, xe, amdgpu ...) of every process but this agent and its children
  (export workers), for their fds that are ``/dev/dri`` nodes: ``drm-engine-<engine>: <N> ns``
  (busy time over wall time) or, without those, ``drm-cycles-<engine>`` over
  ``drm-total-cycles-<engine>`` (xe). A client (``drm-pdev``, ``drm-client-id``) open in several
  fds or processes counts once; ``drm-engine-capacity-<engine>: N`` is N identical engines.
  Clients' shares add up per GPU and engine. Processes it may not read are skipped.
* Windows: the ``\\GPU Engine(*)\\Utilization Percentage`` counters (PDH), instances named
  ``pid_<pid>_luid_..._eng_<n>_engtype_<type>``: other processes' percentages added up per engine.
* Elsewhere: None.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

ENGINE_RE = re.compile(r"^drm-(engine-capacity|engine|total-cycles|cycles)-(\S+):\s*(\d+)(\s*ns)?\s*$")
PDH_INSTANCE_RE = re.compile(r"^pid_(\d+)_(.*)$")
MAX_DEPTH = 64  # parent links followed to find this agent among a process's ancestors


@dataclass(frozen=True)
class Client:
    """One DRM client's counters, from one fdinfo file."""

    key: tuple[str, str]  # (drm-pdev, or the driver; drm-client-id)
    busy: Mapping[str, int]  # engine -> busy ns, or busy cycles where ``total`` has the engine
    total: Mapping[str, int]  # engine -> the GPU's cycles (xe), for engines counted in cycles
    capacity: Mapping[str, int]  # engine -> how many identical engines it stands for (absent: 1)


def parse_fdinfo(text: str, fallback_id: str = "") -> Client | None:
    """A DRM client from an fdinfo file's text (None: not a DRM file, or no engine counters)."""
    fields: dict[str, str] = {}
    ns: dict[str, int] = {}
    num: dict[str, dict[str, int]] = {"engine-capacity": {}, "cycles": {}, "total-cycles": {}}
    for line in text.splitlines():
        m = ENGINE_RE.match(line)
        if m and m.group(1) == "engine":
            if m.group(4):  # "drm-engine-<name>: <N> ns"
                ns[m.group(2)] = int(m.group(3))
        elif m:
            num[m.group(1)][m.group(2)] = int(m.group(3))
        elif ":" in line:
            k, _, v = line.partition(":")
            fields[k.strip()] = v.strip()
    if "drm-driver" not in fields:
        return None
    key = (fields.get("drm-pdev") or fields["drm-driver"], fields.get("drm-client-id") or fallback_id)
    busy, total = ns, {}
    if not ns:
        tot = num["total-cycles"]
        busy = {e: c for e, c in num["cycles"].items() if e in tot}
        total = {e: tot[e] for e in busy}
    capacity = {e: c for e, c in num["engine-capacity"].items() if c > 0}
    return Client(key, busy, total, capacity) if busy else None


def busiest(prev: Mapping[tuple[str, str], Client], cur: Mapping[tuple[str, str], Client], wall_ns: int) -> float:
    """The busiest engine's share over an interval, from its clients' counters at both ends (pure)."""
    share: dict[tuple[str, str], float] = {}
    for key, c in cur.items():
        p = prev.get(key)
        if p is None:  # a new client: its time before this interval is not this interval's
            continue
        for eng, busy in c.busy.items():
            if eng not in p.busy or (eng in c.total) != (eng in p.total):
                continue
            span = c.total[eng] - p.total[eng] if eng in c.total else wall_ns
            if span > 0 and busy > p.busy[eng]:
                e = (key[0], eng)
                share[e] = share.get(e, 0.0) + (busy - p.busy[eng]) / span / c.capacity.get(eng, 1)
    return max(0.0, min(1.0, max(share.values(), default=0.0)))


def _keep_larger(prev: Mapping[tuple[str, str], Client], cur: dict[tuple[str, str], Client]) -> None:
    """A counter read lower than before stays at its larger previous value (the kernel's rule)."""
    for key, c in cur.items():
        p = prev.get(key)
        if p is not None and any(p.busy.get(e, 0) > b for e, b in c.busy.items()):
            cur[key] = Client(key, {e: max(b, p.busy.get(e, 0)) for e, b in c.busy.items()}, c.total, c.capacity)


def windows_share(items: Iterable[tuple[str, float]], ours: set[int]) -> float | None:
    """The busiest engine's summed percentage of other processes, from PDH instances (pure)."""
    per_engine: dict[str, float] = {}
    for name, pct in items:
        m = PDH_INSTANCE_RE.match(name)
        if m is None or int(m.group(1)) in ours:
            continue
        per_engine[m.group(2)] = per_engine.get(m.group(2), 0.0) + pct
    if not per_engine:
        return None
    return max(0.0, min(1.0, max(per_engine.values()) / 100.0))


class _PdhValue(ctypes.Structure):
    _fields_ = [("CStatus", ctypes.c_ulong), ("doubleValue", ctypes.c_double)]


class _PdhItem(ctypes.Structure):
    _fields_ = [("name", ctypes.c_wchar_p), ("value", _PdhValue)]


class _WindowsEngines:
    """The GPU Engine counters, through one PDH query kept open (a rate needs two samples)."""

    def __init__(self) -> None:
        self.pdh: Any = ctypes.windll.pdh  # type: ignore[attr-defined,unused-ignore]
        self.query, self.counter = ctypes.c_void_p(), ctypes.c_void_p()
        if self.pdh.PdhOpenQueryW(None, 0, ctypes.byref(self.query)) != 0:
            raise OSError("PdhOpenQueryW failed")
        path = r"\GPU Engine(*)\Utilization Percentage"
        if self.pdh.PdhAddEnglishCounterW(self.query, path, 0, ctypes.byref(self.counter)) != 0:
            self.pdh.PdhCloseQuery(self.query)
            raise OSError("no GPU Engine counters")
        self.pdh.PdhCollectQueryData(self.query)

    def items(self) -> list[tuple[str, float]]:
        if self.pdh.PdhCollectQueryData(self.query) != 0:
            return []
        fmt, size, count = 0x200, ctypes.c_ulong(0), ctypes.c_ulong(0)  # PDH_FMT_DOUBLE
        for _ in range(3):  # instances come and go between the two calls: PDH_MORE_DATA again
            self.pdh.PdhGetFormattedCounterArrayW(self.counter, fmt, ctypes.byref(size), ctypes.byref(count), None)
            buf = (ctypes.c_byte * size.value)()
            got = self.pdh.PdhGetFormattedCounterArrayW(self.counter, fmt, ctypes.byref(size), ctypes.byref(count), buf)
            if got == 0:
                arr = ctypes.cast(buf, ctypes.POINTER(_PdhItem))
                rows = (arr[i] for i in range(count.value))
                return [(r.name, r.value.doubleValue) for r in rows if r.value.CStatus in (0, 1)]
        return []


class GpuLoad:
    def __init__(
        self, proc: str | Path = "/proc", me: int | None = None, clock: Callable[[], int] = time.monotonic_ns
    ) -> None:
        self.proc = Path(proc)
        self.me = os.getpid() if me is None else me
        self.clock = clock
        self._last: tuple[int, dict[tuple[str, str], Client]] | None = None
        self._windows: _WindowsEngines | None = None
        self._windows_failed = False

    def read(self) -> float | None:
        """Other programs' share of the busiest GPU engine since the previous call (None the first time)."""
        try:
            if sys.platform == "win32":
                return self._read_windows()
            if sys.platform.startswith("linux"):
                return self._read_drm()
        except Exception:
            return None
        return None

    def _read_drm(self) -> float | None:
        now, clients = self.clock(), self.clients()
        last = self._last
        if last is not None:
            _keep_larger(last[1], clients)
        self._last = (now, clients)
        if last is None or not clients or now <= last[0]:
            return None
        return busiest(last[1], clients, now - last[0])

    def clients(self) -> dict[tuple[str, str], Client]:
        """The DRM clients open in other processes now (those shared with this agent left out)."""
        others: dict[tuple[str, str], Client] = {}
        ours: set[tuple[str, str]] = set()
        for name in os.listdir(self.proc):
            if name.isdigit():
                found = self._clients_of(name)
                if found and self._is_ours(int(name)):
                    ours.update(c.key for c in found)
                else:
                    for c in found:
                        others.setdefault(c.key, c)
        return {k: c for k, c in others.items() if k not in ours}

    def _clients_of(self, pid: str) -> list[Client]:
        fd_dir, out = self.proc / pid / "fd", []
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # not ours to read, or gone
            return []
        for fd in fds:
            try:
                if not os.readlink(fd_dir / fd).startswith("/dev/dri/"):
                    continue
                c = parse_fdinfo((self.proc / pid / "fdinfo" / fd).read_text(errors="replace"), f"{pid}/{fd}")
            except OSError:
                continue
            if c is not None:
                out.append(c)
        return out

    def _is_ours(self, pid: int) -> bool:
        for _ in range(MAX_DEPTH):
            if pid == self.me:
                return True
            try:
                stat = (self.proc / str(pid) / "stat").read_text()
                pid = int(stat.rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ..."
            except (OSError, ValueError, IndexError):  # past pid 1 (its parent is 0), or unreadable
                return False
        return False

    def _read_windows(self) -> float | None:
        if self._windows is None:
            if self._windows_failed:
                return None
            try:
                self._windows = _WindowsEngines()
            except Exception:
                self._windows_failed = True
            return None  # the first sample: no interval yet
        ours = {self.me}
        with contextlib.suppress(psutil.Error):
            ours |= {p.pid for p in psutil.Process(self.me).children(recursive=True)}
        return windows_share(self._windows.items(), ours)
