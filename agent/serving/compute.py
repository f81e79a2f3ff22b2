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

Spinning pays only when the next frame tends to come within the spin window. A stage that
waits on something slow between its steps (a speculative round's draft tokens, computed on
cores it shares; a WAN hop of 100 ms) would burn ``spin_s`` of its core for nothing after
every step, and slow a co-located draft. So the thread keeps the idle gaps of its last
``GAP_WINDOW`` jobs (job submitted minus thread gone idle; 0 when a job was already queued)
and spins only while their median is within ``spin_s`` (:func:`spin_pays`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
_SPIN_BUF = bytes(64 * 1024)
_STOP = object()
# give the core up to any runnable thread: sched_yield where there is one; Sleep(0) on Windows
_yield_core: Callable[[], None] = getattr(os, "sched_yield", None) or functools.partial(time.sleep, 0)
GAP_WINDOW = 8  # idle gaps remembered to decide whether spinning pays


def spin_pays(gaps: Iterable[float], spin_s: float) -> bool:
    """Whether to spin after a job, given the idle gaps (s) before the last few jobs.

    No spinning when it is switched off; spin while there is no history yet (a stream that
    just started); otherwise spin when the typical (median) gap fits in the spin window.
    """
    if spin_s <= 0.0:
        return False
    seen = list(gaps)
    return not seen or statistics.median(seen) <= spin_s


class ComputeThread:
    def __init__(self, spin_s: float = 0.05, name: str = "stage-compute") -> None:
        self.spin_s = spin_s
        # the share of the time it may compute (a limited node: each job is followed by a rest)
        self.duty = 1.0
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.busy_s = 0.0  # time spent running jobs
        self.spun_s = 0.0  # time spent spinning for the next job
        self.gaps: deque[float] = deque(maxlen=GAP_WINDOW)  # idle gaps before recent jobs
        self._thread.start()

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
        self._q.put((fn, args, asyncio.get_running_loop(), done, time.monotonic()))

    def _next(self, spin_until: float) -> Any:
        t0 = time.monotonic()
        while (now := time.monotonic()) < spin_until:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                # Burn ~30 us *without the GIL* (hashing a buffer releases it), so the event
                # loop thread takes the GIL the moment a frame arrives; a bare yield loop would
                # grab it back at once and starve the loop on a multi-core node. Then give
                # the core up to any runnable thread: on one core, the event loop.
                hashlib.sha256(_SPIN_BUF)
                _yield_core()
            else:
                self.spun_s += now - t0
                return item
        if spin_until > t0:
            self.spun_s += spin_until - t0
        return self._q.get()

    def _loop(self) -> None:
        spin_until = 0.0
        idle_from = time.monotonic()
        while True:
            item = self._next(spin_until)
            if item is _STOP:
                return
            fn, args, loop, done, queued_at = item
            self.gaps.append(max(0.0, queued_at - idle_from))
            t0 = time.monotonic()
            try:
                res = fn(*args)
            except BaseException as e:  # delivered to the event loop
                _call(loop, done, None, e)
            else:
                _call(loop, done, res, None)
            # the event loop was just woken to send the result on: on one core, let it run now
            _yield_core()
            idle_from = time.monotonic()
            self.busy_s += idle_from - t0
            duty = self.duty
            if duty < 1.0:  # limited: rest in proportion, and leave the core to its user
                time.sleep((idle_from - t0) * (1.0 - duty) / max(duty, 0.01))
                idle_from = time.monotonic()
                spin_until = 0.0
                continue
            spin_until = idle_from + self.spin_s if spin_pays(self.gaps, self.spin_s) else 0.0

    def pace(self, duty: float, spin_s: float) -> None:
        """The share of the time it may compute, and how long it spins for the next job (from
        any thread: each is one value the thread reads once per job)."""
        self.duty, self.spin_s = duty, spin_s

    def shutdown(self) -> None:
        self._q.put(_STOP)


def _call(loop: asyncio.AbstractEventLoop, done: Callable[..., None], res: Any, exc: BaseException | None) -> None:
    try:
        loop.call_soon_threadsafe(done, res, exc)
    except RuntimeError:  # the loop has closed: nobody is waiting any more
        log.debug("result dropped: event loop closed")
