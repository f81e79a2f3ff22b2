"""A benchmark can tell whether other processes used the machine while it timed its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from coordinator.lab.machine_load import OthersWindow, busy_cpu_s, others_share

pytestmark = pytest.mark.skipif(busy_cpu_s() is None, reason="no /proc/stat here")

SPIN = "import time\nprint('spinning', flush=True)\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass\n"


def _spin_within(pids_of: str) -> OthersWindow:
    """A 1.2 s window while a process spins; it counts as the bench's own if ``pids_of`` says so."""
    p = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "spinning\n"  # started: the window is all spin
        w = OthersWindow([os.getpid(), p.pid] if pids_of == "own" else [os.getpid()])
        time.sleep(1.2)  # the window measured (the scenario, not a wait): inside the spinner's 1.5 s
        return w.close()
    finally:
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


def test_a_busy_stranger_shows_as_others_and_the_bench_s_own_process_does_not() -> None:
    stranger = _spin_within("stranger")
    assert stranger.others_s is not None and stranger.others_s > 0.7, stranger.others_s
    share = others_share([stranger])
    assert share is not None and share > 0.7 / (stranger.wall_s * len(os.sched_getaffinity(0)))
    own = _spin_within("own")
    assert own.others_s is not None and own.others_s < stranger.others_s - 0.5, (own.others_s, stranger.others_s)


def test_an_unknown_window_makes_the_share_unknown() -> None:
    w = OthersWindow([os.getpid()]).close()
    w.others_s = None  # as where /proc/stat cannot be read
    assert others_share([w]) is None
    assert others_share([]) is None
