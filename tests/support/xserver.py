"""Helpers for tests that need a real display: the X server and input come from
:mod:`coordinator.lab.xdisplay` (the throttle benchmark uses the same)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from typing import TypeVar

from coordinator.lab.xdisplay import touch, xvfb

T = TypeVar("T")
__all__ = ["missing", "touch", "wait_for", "xvfb"]


def missing(*tools: str) -> list[str]:
    return [t for t in tools if shutil.which(t) is None]


def wait_for(what: str, fn: Callable[[], T], timeout: float = 30.0, step: float = 0.2) -> T:
    end = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(step)
