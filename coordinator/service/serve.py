"""``lakeshard serve``: run one coordinator until SIGINT or SIGTERM, then exit within about a second."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

from agent.common import aio
from agent.node.shutdown import describe, exit_now
from coordinator.service.config import ServeConfig
from coordinator.service.coordinator import Coordinator
from coordinator.service.listener import STOP_GRACE_S

log = logging.getLogger(__name__)


async def async_serve(cfg: ServeConfig) -> None:
    """Start a coordinator for ``cfg`` and serve until a signal; then stop it, briefly."""
    coord = Coordinator(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    start = asyncio.ensure_future(coord.async_start())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([start, stopping], return_when=asyncio.FIRST_COMPLETED)
        if start.done():
            start.result()  # a failed start raises here
            print(
                f"lakeshard: serving {cfg.model.name} on {len(cfg.nodes)} nodes; API {coord.api_url}/v1; "
                f"limits: {cfg.api_limits.describe()}",
                flush=True,
            )
            await stopping
        else:
            log.info("stopped while starting")
    finally:
        try:
            await asyncio.wait_for(_async_stop(coord, start, stopping), STOP_GRACE_S * 2)
        except (TimeoutError, Exception) as e:
            log.warning("shutdown cut short: %s", describe(e))  # (a TimeoutError's message is empty)


async def _async_stop(coord: Coordinator, *tasks: asyncio.Future[Any]) -> None:
    """Cancel the start (when still under way) and the wait for a signal, then stop ``coord``."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)  # (a failed start was raised already)
    await coord.async_stop()


def run_coordinator(cfg: ServeConfig) -> None:
    """``lakeshard serve``: serve until SIGINT or SIGTERM, then exit within about a second."""
    # without waiting for worker threads (a spare export): their child processes end first
    try:
        aio.run(async_serve(cfg))
    except KeyboardInterrupt:
        exit_now(130)
    exit_now(0)
