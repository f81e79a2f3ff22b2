"""What the coordinator's collaborators (failover, rebalancing, the cluster view) see of it.

A Protocol, so that they need not import :mod:`coordinator.service.coordinator` (which builds
them): the plan now running (its nodes, term and pipeline), the lock under which a plan
changes, and the two ways a plan changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from agent.api.events import EventHub
from agent.export.exporter import ExportResult
from coordinator.batching.batcher import Batcher
from coordinator.batching.scheduler import Scheduler
from coordinator.planning.calibration import CalibrationStore
from coordinator.ring.pipeline import Pipeline
from coordinator.service.config import ServeConfig
from coordinator.service.exports import StageExports
from coordinator.service.preparing import Preparer


class Core(Protocol):
    """The coordinator as its collaborators use it."""

    cfg: ServeConfig
    term: int
    nodes: list[str]  # the agents of the current plan, in stage order
    pipeline: Pipeline | None
    scheduler: Scheduler | Batcher | None
    calibration: CalibrationStore
    exports: StageExports
    plan_lock: asyncio.Lock  # one plan change at a time (a re-plan, a recovery)
    hub: EventHub
    prep: Preparer
    node_ids: dict[str, str]  # agent address -> node id, where known

    @property
    def export(self) -> ExportResult | None: ...

    async def async_move_to(self, nodes: Sequence[str], split: Sequence[int] | None = None) -> Pipeline: ...

    async def async_replan(self, nodes: Sequence[str], split: Sequence[int] | None = None) -> None: ...
