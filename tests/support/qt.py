"""Running coroutines on the Qt event loop in tests (waits on it: :func:`tests.support.wait.async_wait_until`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


def run(loop: asyncio.AbstractEventLoop, coro: Awaitable[Any], timeout: float = 300.0) -> Any:
    """Run ``coro`` on the Qt event loop, failing after ``timeout`` s rather than hanging."""
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))
