"""The stage's compute thread: runs OpenVINO work off the event loop, in submission order.

Between steps of an active pipeline a stage waits a few milliseconds for its next frame. If
its core goes idle in that gap, the next step runs measurably slower (a waking core, cold
caches; measured here on a VM: about 20% per step). So after each job the thread keeps its
core busy for up to ``spin_s`` while polling for the next job, holding the GIL only for the
poll itself, so the event loop still receives frames at once. ``spin_s = 0`` (for example
when the laptop's user needs it, or on battery) blocks instead.

Each spin also yields the core to any other runnable thread (``sched_yield``): on a node of
one core the event loop shares it with the spinning thread, and without the yield it waited
for the spinner's time slice to send a finished step on (1.6-1.8 ms median, 4-5 ms p90 a
step) and to take in the next frame (2.4 ms against 1.0 ms a hop), measured on a 2-stage
pipeline of one core per stage. The thread also yields once right after handing a result to
the event loop, before its first spin: the loop, just woken, sends the step on at once
(a finished step reached the event loop in 0.19-0.21 ms instead of 0.25, same trace).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
_SPIN_BUF = bytes(64 * 1024)
_STOP = object()
# give the core up to any runnable thread: sched_yield where there is one; Sleep(0) on Windows
_yield_core: Callable[[], None] = getattr(os, "sched_yield", None) or functools.partial(time.sleep, 0)


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

        def done(res: Any, exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(res)

        self.submit(fn, args, done)
        return await fut

    def submit(
        self, fn: Callable[..., Any], args: tuple[Any, ...], done: Callable[[Any, BaseException | None], None]
    ) -> None:
        """Queue ``fn(*args)``; ``done(result, exception)`` then runs on the caller's event loop.

        Jobs run in submission order, back to back: the next one starts without waiting for
        the event loop to collect the previous result.
        """
        self._q.put((fn, args, asyncio.get_running_loop(), done))

    def _next(self, spin_until: float) -> Any:
        while time.monotonic() < spin_until:
            try:
                return self._q.get_nowait()
            except queue.Empty:
                # Burn ~30 us *without the GIL* (hashing a buffer releases it), so the event
                # loop thread takes the GIL the moment a frame arrives; a bare yield loop would
                # grab it back at once and starve the loop on a multi-core node. Then give
                # the core up to any runnable thread: on one core, the event loop.
                hashlib.sha256(_SPIN_BUF)
                _yield_core()
        return self._q.get()

    def _loop(self) -> None:
        spin_until = 0.0
        while True:
            item = self._next(spin_until)
            if item is _STOP:
                return
            fn, args, loop, done = item
            t0 = time.monotonic()
            try:
                res = fn(*args)
            except BaseException as e:  # delivered to the event loop
                _call(loop, done, None, e)
            else:
                _call(loop, done, res, None)
            # the event loop was just woken to send the result on: on one core, let it run now
            _yield_core()
            now = time.monotonic()
            self.busy_s += now - t0
            spin_until = now + self.spin_s

    def shutdown(self) -> None:
        self._q.put(_STOP)


def _call(loop: asyncio.AbstractEventLoop, done: Callable[..., None], res: Any, exc: BaseException | None) -> None:
    try:
        loop.call_soon_threadsafe(done, res, exc)
    except RuntimeError:  # the loop has closed: nobody is waiting any more
        log.debug("result dropped: event loop closed")
