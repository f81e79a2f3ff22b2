"""Helpers for tests that need a real display: the X server and input come from
:mod:`coordinator.lab.xdisplay` (the throttle benchmark uses the same)."""

from __future__ import annotations

import shutil

from coordinator.lab.xdisplay import touch, xvfb

__all__ = ["missing", "touch", "xvfb"]


def missing(*tools: str) -> list[str]:
    return [t for t in tools if shutil.which(t) is None]
