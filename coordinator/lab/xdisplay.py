"""A throwaway X server (Xvfb) and a "user" on it (xdotool): for benchmarks and tests of what
the agent does when its laptop's user is active."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager


def _up(env: dict[str, str]) -> bool:
    return subprocess.run(["xdotool", "getdisplaygeometry"], env=env, capture_output=True).returncode == 0


@contextmanager
def xvfb(size: str = "1024x768x24", timeout: float = 30.0) -> Iterator[dict[str, str]]:
    """An X server on a free display number; yields an environment that uses it."""
    n = 100 + (os.getpid() * 7 + int(time.time())) % 800
    while os.path.exists(f"/tmp/.X11-unix/X{n}") or os.path.exists(f"/tmp/.X{n}-lock"):
        n += 1
    proc = subprocess.Popen(["Xvfb", f":{n}", "-screen", "0", size, "-nolisten", "tcp"], stderr=subprocess.DEVNULL)
    env = {**os.environ, "DISPLAY": f":{n}"}
    try:
        end = time.monotonic() + timeout
        while not _up(env):
            if time.monotonic() > end or proc.poll() is not None:
                raise RuntimeError(f"Xvfb :{n} did not start")
            time.sleep(0.1)
        yield env
    finally:
        proc.terminate()
        proc.wait(10)


def touch(env: dict[str, str], x: int = 10, y: int = 10) -> None:
    """User input on that display (a mouse move)."""
    subprocess.run(["xdotool", "mousemove", str(x), str(y)], env=env, check=True, timeout=10)
