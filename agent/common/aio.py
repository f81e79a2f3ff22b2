"""Event loop choice: uvloop where it exists (Linux, macOS), the standard loop elsewhere (Windows)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the fastest loop available."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
