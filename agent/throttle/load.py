"""Foreground load: how much of the machine's CPU the laptop's other programs use.

Busy CPU time of the whole machine (psutil) minus this agent's own process and its children
(export workers), over the interval since the last reading, as a share of all cores. The GPU's
foreground load (per-process engine time: DRM fdinfo on Linux, PDH counters on Windows) is
:mod:`agent.throttle.gpu_load`'s.
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil


def _busy(t: object) -> float:
    """Busy seconds in a ``psutil.cpu_times()`` record (everything but idle and iowait)."""
    total = sum(getattr(t, f) for f in t._fields)  # type: ignore[attr-defined]
    return float(total - getattr(t, "idle", 0.0) - getattr(t, "iowait", 0.0))


class ForegroundLoad:
    def __init__(self) -> None:
        self.me = psutil.Process(os.getpid())
        self.cores = psutil.cpu_count() or 1
        self._last: tuple[float, float, float] | None = None  # (wall, machine busy, ours)

    def _ours(self) -> float:
        total = 0.0
        procs = [self.me]
        with contextlib.suppress(psutil.Error):
            procs += self.me.children(recursive=True)
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    def read(self) -> float | None:
        """Other programs' share of all cores since the previous call (None the first time)."""
        try:
            now, busy, ours = time.monotonic(), _busy(psutil.cpu_times()), self._ours()
        except Exception:
            return None
        last, self._last = self._last, (now, busy, ours)
        if last is None or now - last[0] <= 0:
            return None
        others = (busy - last[1]) - (ours - last[2])
        return max(0.0, min(1.0, others / ((now - last[0]) * self.cores)))
