"""Rebalancing: fit what the output head costs from the stages' measured step times, and move
the split when a better one pays (once, some time after the start, or when asked)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import aiohttp

from coordinator.planning.batch_cost import Curve, fit_curve
from coordinator.planning.calibration import fit_head_layers, propose, stage_rows_ms, stage_time
from coordinator.service.config import plan_ranges

if TYPE_CHECKING:
    from coordinator.service.shared import Core

log = logging.getLogger(__name__)
BATCH_CURVE_S = 30.0  # how often the paged stages' step times by batch size are fitted
AUTO_REBALANCE_S = 5.0  # how often the automatic rebalance looks whether the stages have measured enough


class Rebalancer:
    """The coordinator's split, moved by measurement."""

    def __init__(self, coord: Core) -> None:
        self.coord = coord
        self.rebalances: list[dict[str, object]] = []
        self._auto: asyncio.Task[None] | None = None
        self._curves: asyncio.Task[None] | None = None
        self.curve: Curve | None = None  # the last batch curve fitted here

    async def async_start(self) -> None:
        """Rebalance once, as soon as every stage has timed enough steps (in the background);
        keep the batch curve of paged stages measured meanwhile."""
        self._auto = asyncio.create_task(self._async_auto())
        self._curves = asyncio.create_task(self._async_curves())

    async def _async_curves(self) -> None:
        while True:
            await asyncio.sleep(BATCH_CURVE_S)
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                await self.async_batch_curve()

    async def async_batch_curve(self) -> Curve | None:
        """Fit the paged stages' step times by batch size into the batch curve the planner
        uses for this model and weights, and store it (None: not enough measured yet)."""
        rows = [r for r in (stage_rows_ms(st) for st in await self._async_statuses()) if r]
        curve = fit_curve(rows)
        if curve is not None and curve != self.curve:
            self.curve = curve
            self.coord.calibration.update_curve(self.coord.cfg.calib_key, curve)
            log.info("measured batch curve (step time against one row's): %s", curve)
        return curve

    async def _async_auto(self) -> None:
        while True:
            await asyncio.sleep(AUTO_REBALANCE_S)
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                if await self.async_rebalance() is not None:
                    return

    async def _async_statuses(self) -> list[Any]:
        tr = self.coord.cfg.transport
        async with tr.session(timeout=aiohttp.ClientTimeout(total=5)) as s:
            statuses = []
            for node in self.coord.nodes:
                async with s.get(tr.url(node, "/v1/node")) as r:
                    statuses.append(await r.json())
        return statuses

    async def async_rebalance(self, min_gain: float = 0.05) -> dict[str, object] | None:
        """Fit the head's cost from the stages' measured step times; re-plan when that pays.

        The fit is stored for later plans. The move itself is ``Coordinator.async_replan``: streams
        in flight carry on, on the new split, without losing a token. Returns what was decided,
        or None when the stages have not measured enough yet (or the split is fixed).
        """
        c = self.coord
        cfg = c.cfg
        if cfg.split or len(c.nodes) < 2 or c.pipeline is None:
            return None
        times = [stage_time(st) for st in await self._async_statuses()]
        if any(t is None for t in times):
            return None
        stages = [t for t in times if t is not None]
        head = fit_head_layers(stages)
        if head is None:
            return None
        c.calibration.update(cfg.calib_key, head)
        p = propose(stages, head, lambda h: plan_ranges(cfg.model, len(stages), None, h))
        decision: dict[str, object] = {
            "head_layers": round(head, 2),
            "step_ms": [s.step_ms for s in stages],
            "ranges": p.ranges,
            "predicted_ms": round(p.predicted_ms, 3),
            "replanned": p.pays(min_gain),
        }
        log.info("measured split costs: %s", decision)
        if p.pays(min_gain):
            await c.async_replan(c.nodes, [e for _, e in p.ranges[:-1]])
        self.rebalances.append(decision)
        return decision

    async def async_stop(self) -> None:
        for task in (self._auto, self._curves):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._auto = self._curves = None
