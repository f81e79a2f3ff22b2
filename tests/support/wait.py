"""Waiting in tests: ask again until a condition holds, or fail saying what was awaited and what was seen.

The one way the suite waits for something to happen (a process to answer, a message to arrive,
a state to change): :func:`wait_until` from a test's own thread, :func:`async_wait_until` on an
event loop (asyncio's or Qt's). A timeout always reads the same way: what the test waited for,
how long, and the last value it saw (or the last error it let pass), so a failure on a loaded CI
machine says whether the thing was slow, stuck, or wrong.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(
    probe: Callable[[], T],
    timeout: float = 30.0,
    *,
    what: str,
    ok: Callable[[T], object] = bool,
    step: float = 0.2,
    ignore: tuple[type[BaseException], ...] = (),
    diagnose: Callable[[], object] | None = None,
) -> T:
    """Call ``probe`` every ``step`` s until ``ok(value)`` holds (by default: the value is truthy);
    that value.

    ``ignore``: errors of these types mean "not yet" (e.g. OSError while a server starts); any
    other error, a failed assertion in ``probe`` included, fails at once. The probe runs once
    more after the deadline, so a condition met just in time counts. After ``timeout`` s: an
    AssertionError naming ``what`` and the last value seen, with ``diagnose()`` (e.g. log tails)."""
    end = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = probe()
        except ignore as e:
            last = e
        else:
            if ok(value):
                return value
            last = value
        if time.monotonic() >= end:
            raise AssertionError(_timed_out(what, timeout, last, diagnose))
        time.sleep(step)


async def async_wait_until(
    probe: Callable[[], T | Awaitable[T]],
    timeout: float = 30.0,
    *,
    what: str,
    ok: Callable[[T], object] = bool,
    step: float = 0.02,
    ignore: tuple[type[BaseException], ...] = (),
    diagnose: Callable[[], object] | None = None,
) -> T:
    """:func:`wait_until` on the running event loop: it sleeps with ``asyncio.sleep`` so the loop
    (and what the test waits on) runs meanwhile; ``probe`` may be a coroutine function."""
    end = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            got = probe()
            value: T = await got if inspect.isawaitable(got) else got  # type: ignore[assignment]
        except ignore as e:
            last = e
        else:
            if ok(value):
                return value
            last = value
        if time.monotonic() >= end:
            raise AssertionError(_timed_out(what, timeout, last, diagnose))
        await asyncio.sleep(step)


def _timed_out(what: str, timeout: float, last: Any, diagnose: Callable[[], object] | None) -> str:
    msg = f"timed out after {timeout:g} s waiting for {what}; last seen: {_short(repr(last))}"
    if diagnose is not None:
        msg += f"\n{diagnose()}"
    return msg


def _short(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else f"{text[: limit // 2]} … {text[-limit // 2 :]}"
