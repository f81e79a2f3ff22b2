"""The stage's compute thread: runs OpenVINO work off the event loop, in submission order.

Between steps of an active pipeline a stage waits a few milliseconds for its next frame. If
its core goes idle in that gap, the next step runs measurably slower (a waking core, cold
caches; measured here on a VM: about 20% per step). So after each job the thread keeps its
core busy for up to ``spin_s`` while polling for the next job, yielding the CPU and the GIL
on every poll so the event loop still receives frames at once. ``spin_s = 0`` (for example
when the laptop's user needs it, or on battery) blocks instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))
_STOP = object()


class ComputeThread:
    def __init__(self, spin_s: float = 0.05, name: str = "stage-compute") -> None:
        self.spin_s = spin_s
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self.busy_s = 0.0

    async def async_run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._q.put((fn, args, loop, fut))
        return await fut

    def _next(self, spin_until: float) -> Any:
        while time.monotonic() < spin_until:
            try:
                return self._q.get_nowait()
            except queue.Empty:
                _yield()  # releases the GIL and the CPU to whoever needs them
        return self._q.get()

    def _loop(self) -> None:
        spin_until = 0.0
        while True:
            item = self._next(spin_until)
            if item is _STOP:
                return
            fn, args, loop, fut = item
            t0 = time.monotonic()
            try:
                res = fn(*args)
            except BaseException as e:  # delivered to the awaiting coroutine
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, res)
            now = time.monotonic()
            self.busy_s += now - t0
            spin_until = now + self.spin_s

    def shutdown(self) -> None:
        self._q.put(_STOP)


def _set_result(fut: asyncio.Future[Any], res: Any) -> None:
    if not fut.done():
        fut.set_result(res)


def _set_exception(fut: asyncio.Future[Any], e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
