"""Running coroutines on the Qt event loop in tests, and waiting on it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


def run(loop: asyncio.AbstractEventLoop, coro: Awaitable[Any], timeout: float = 300.0) -> Any:
    """Run ``coro`` on the Qt event loop, failing after ``timeout`` s rather than hanging."""
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


async def until(what: str, pred: Callable[[], Any], timeout: float = 30.0, step: float = 0.02) -> Any:
    """Wait on the loop until ``pred()`` is true (its value), failing with ``what`` after ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(step)
