"""Leaving quickly: ``lakeshard agent`` and ``lakeshard serve`` exit within about 1.5 s of SIGTERM or SIGINT.

A laptop that shuts down gives its programs a few seconds at most. What the other nodes need
from a leaving agent is short: its last beat (a coordinator says it stepped down), its mDNS
goodbye, an error chunk for the streams in flight. Each of those steps is bounded here
(:func:`bounded`), and then the process exits without waiting for what is left
(:func:`exit_now`): worker threads (a capacity probe, an export), an export's child process,
OpenVINO's objects torn down at interpreter exit (seconds, measured), websocket close
handshakes with peers that are gone. :func:`exit_after` is the last resort when the event loop
itself is stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Awaitable
from typing import Any, NoReturn

log = logging.getLogger(__name__)
SHUTDOWN_S = 1.5  # the graceful part's whole budget, from the signal
HARD_EXIT_S = 1.8  # from the signal: exit even when the event loop does not come back


def describe(e: BaseException) -> str:
    """An exception as a log line names it: its type, and its message when it has one
    (``str(TimeoutError())`` is empty)."""
    s = str(e)
    return f"{type(e).__name__}: {s}" if s else type(e).__name__


async def bounded(aw: Awaitable[Any], seconds: float, what: str) -> bool:
    """Await ``aw`` for at most ``seconds``; False when it was cut short.

    Past its time the step is cancelled and left behind, not waited for (unlike ``wait_for``,
    which waits for the cancellation to finish: a step that swallows it would hold the exit up).
    A step that fails is logged, never raised: the steps after it still run."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        log.info("shutdown: %s cut short after %.1f s (left behind: the process exits)", what, seconds)
        return False
    e = None if task.cancelled() else task.exception()
    if e is not None:
        log.warning("shutdown: %s failed: %s", what, describe(e))
    return True


def exit_now(code: int) -> NoReturn:
    """Exit at once: end this process's children (an export), flush the logs, ``os._exit``.

    Worker threads are not waited for, and nothing is torn down one object at a time."""
    with contextlib.suppress(Exception):
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.terminate()
    with contextlib.suppress(Exception):
        logging.shutdown()
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    os._exit(code)


def exit_after(seconds: float, code: int = 0) -> threading.Timer:
    """Exit ``seconds`` from now whatever the event loop is doing (a step that blocks it)."""

    def fire() -> None:
        with contextlib.suppress(Exception):
            log.warning("shutdown: still running %.1f s after the signal; exiting now", seconds)
        exit_now(code)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    return t
