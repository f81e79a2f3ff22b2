"""The coordinator's failover: when a stage's agent is lost, re-plan over the agents still
usable, in a new term, and let the streams replay there (the scheduler resumes them).

To make that quick, the split for one node fewer is exported ahead of need after every plan
change (the spare): a recovery then finds its stages on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import aiohttp

from agent.protocol.events import Failover as FailoverEvent
from agent.security.transport import Transport
from coordinator.planning.planner import PlanError
from coordinator.ring.pipeline import Pipeline, PipelineError
from coordinator.service.config import plan_ranges

if TYPE_CHECKING:
    from collections.abc import Sequence

    from coordinator.service.shared import Core

log = logging.getLogger(__name__)


async def usable(node: str, paused: set[str], tr: Transport, timeout: float = 1.0) -> bool:
    """Whether the agent at ``node`` can take a stage now: it answers, and is not paused (as it
    says over ``tr``)."""
    if node in paused and not await _not_paused(node, tr, timeout):
        return False
    return await reachable(node, timeout)


async def _not_paused(node: str, tr: Transport, timeout: float) -> bool:
    try:
        async with (
            tr.session(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
            s.get(tr.url(node, "/v1/node")) as r,
        ):
            st = await r.json()
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return False
    return isinstance(st, dict) and st.get("state") != "paused"


async def reachable(node: str, timeout: float = 1.0) -> bool:
    """Whether an agent answers at ``node`` (host:port) right now."""
    host, _, port = node.rpartition(":")
    try:
        _, w = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
    except (OSError, TimeoutError):
        return False
    w.close()
    with contextlib.suppress(OSError):
        await w.wait_closed()
    return True


class Failover:
    """Recovers the coordinator's plan from a lost node, and keeps the spare split ready."""

    def __init__(self, coord: Core) -> None:
        self.coord = coord
        self.recoveries: list[dict[str, object]] = []
        self.fallback_id: str | None = None  # the split for one node fewer, once prepared
        self._spare: asyncio.Task[None] | None = None

    async def async_spare_for(self, nodes: Sequence[str]) -> None:
        """Have the split for one node fewer ready before it is needed (again after every re-plan)."""
        await self._async_cancel_spare()
        self.fallback_id = None
        if self.coord.cfg.failover and len(nodes) > 1:
            self._spare = asyncio.create_task(self._prepare(len(nodes) - 1))

    async def _prepare(self, n: int) -> None:
        c = self.coord
        try:
            ranges = plan_ranges(c.cfg.model, n, None, c.calibration.get(c.cfg.calib_key))
            self.fallback_id = await c.exports.async_spare(ranges)
        except Exception as e:  # only a head start: recovery exports on demand otherwise
            log.info("could not prepare the %d-stage fallback: %s", n, e)

    async def async_recover(self, failed: Pipeline) -> None:
        """``failed`` lost a node: re-plan over the agents still reachable, in a new term.

        One recovery at a time; requests that fail together wait for the same one. Raises a
        PipelineError naming the reason when the survivors cannot carry the model.
        """
        c = self.coord
        async with c.plan_lock:
            if c.pipeline is not failed:
                return  # already replaced
            t0 = time.monotonic()
            live = [n for n in c.nodes if await usable(n, failed.paused, c.cfg.transport)]
            log.warning("re-planning over %d of %d agents after losing %s", len(live), len(c.nodes), failed.lost)
            if not live:
                why = "every agent is paused or gone" if failed.paused else "no agent is reachable any more"
                raise PipelineError(why, "cluster_lost")
            live = live[: c.cfg.model.num_layers]
            try:
                await c.async_move_to(live)
            except (PipelineError, PlanError, OSError) as e:
                raise PipelineError(f"the remaining agents cannot carry the model: {e}", "cluster_lost") from e
            seconds = round(time.monotonic() - t0, 3)
            self.recoveries.append({"lost": failed.lost, "nodes": live, "term": c.term, "seconds": seconds})
            lost = failed.lost or "?"
            c.hub.publish(FailoverEvent(time.time(), c.node_ids.get(lost, lost), seconds, c.term))
            failed.mark_lost(failed.lost or "?")
            await failed.async_close()

    async def _async_cancel_spare(self) -> None:
        """Stop preparing the spare split (an export already in a worker thread runs on: it is
        written to a temporary folder and renamed into place only when complete)."""
        task, self._spare = self._spare, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def async_stop(self) -> None:
        await self._async_cancel_spare()
