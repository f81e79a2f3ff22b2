"""What the rest of the machine did while a benchmark timed its own processes.

A side-by-side ratio (TLS vs plaintext, split vs whole) holds only while nothing else competes for
the cores: on a 2-core machine another job lands on a stage's core in the middle of a token, and
the two sides of a pair meet different loads. :class:`OthersWindow` measures the CPU seconds
that processes other than the benchmark's own used during a window (Linux ``/proc/stat``, steal
included); elsewhere it reports None.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import psutil

SHARED = 0.05  # others' share of the CPU above which a benchmark should say its figures are of a shared machine


def busy_cpu_s() -> float | None:
    """CPU seconds every process on this machine has used so far, None where it cannot be read."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(ticks) < 5:
        return None
    return float(sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def own_cpu_s(pids: list[int]) -> float:
    """CPU seconds the processes ``pids`` have used so far (one gone counts nothing, so a window
    is closed while the processes it leaves out are still running)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


class OthersWindow:
    """From construction to :meth:`close`: CPU seconds used by processes not in ``pids``."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._busy, self._own, self._t0 = busy_cpu_s(), own_cpu_s(pids), time.monotonic()
        self.others_s: float | None = None
        self.wall_s = 0.0

    def close(self) -> OthersWindow:
        busy = busy_cpu_s()
        self.wall_s = time.monotonic() - self._t0
        if busy is not None and self._busy is not None:
            self.others_s = max(0.0, busy - self._busy - (own_cpu_s(self.pids) - self._own))
        return self


def others_share(windows: list[OthersWindow]) -> float | None:
    """The share of this process's usable CPUs that others used over ``windows`` (None: unknown)."""
    if not windows or any(w.others_s is None for w in windows):
        return None
    capacity = sum(w.wall_s for w in windows) * len(os.sched_getaffinity(0))
    return sum(w.others_s or 0.0 for w in windows) / capacity if capacity > 0 else None
