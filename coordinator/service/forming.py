"""How the elected coordinator comes by its plan: take over what runs already (or refit the
nodes left onto an export held here), else plan afresh over the nodes it hears; and, while it
serves, the plan that membership changes call for.

What it decides is a :class:`Formed`: the model, its weights and footprint, the members heard,
the plan, and what a takeover kept and moved.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.cluster.offers import Member
from agent.export.held import FetchError
from agent.models.registry import REGISTRY
from agent.models.store import LocalModel, ModelStore
from agent.security.transport import Transport
from coordinator.planning.batch_cost import Curve
from coordinator.planning.calibration import CalibrationStore, calib_key
from coordinator.planning.planner import Plan, PlanError, StagePlan, footprint, plan_pipeline, prefer_held
from coordinator.service.held import copy_export, held_exports, held_splits, model_for
from coordinator.service.preparing import Preparer
from coordinator.service.takeover import Adoption, Running, adopt

log = logging.getLogger(__name__)
SETTLE_S = 2.0  # after winning, let late peers' beats arrive before planning
ADOPT_SETTLE_S = 0.3  # taking over a running plan: the beats heard during the election are fresh
PROBE_WAIT_S = 20.0  # and give freshly started peers time to measure their speed


@dataclass
class Formed:
    """A plan the coordinator is about to serve, and what it was made from."""

    model: LocalModel
    weights: str
    fp: Any  # the model's footprint (coordinator.planning.planner.footprint)
    members: list[Member]  # the nodes heard when it was made
    plan: Plan
    adoption: Adoption | None = None  # a running plan taken over: what was kept and moved


class Forming:
    """Plans for the elected coordinator (see the module's docstring)."""

    def __init__(
        self,
        *,
        weights: str | None,
        streams: int,
        min_nodes: int,
        my_address: str,
        members: Callable[[], list[Member]],
        needed_before: Callable[[], tuple[str, ...]],
        prep: Preparer,
        transport: Transport,  # how a running plan's export is copied from the nodes that hold it
    ) -> None:
        self.weights, self.streams, self.min_nodes = weights, streams, min_nodes
        self.my_address = my_address
        self.members, self.needed_before = members, needed_before
        self.prep = prep
        self.transport = transport

    def home(self, members: list[Member]) -> str | None:
        """This machine's node id, when its agent is among the members."""
        return next((m.offer.node for m in members if m.address == self.my_address), None)

    def weights_for(self, name: str) -> str:
        spec = REGISTRY.get(name)
        return self.weights or (spec.default_weights if spec else "int4")

    async def async_plan(self, ref: str) -> Formed:
        """Plan afresh: wait for the nodes' beats and speeds, resolve (or pull) the model, split it."""
        await asyncio.sleep(SETTLE_S)
        t0 = time.monotonic()
        while time.monotonic() - t0 < PROBE_WAIT_S and not all(m.measured for m in self.members()):
            await asyncio.sleep(0.25)
        loop = asyncio.get_running_loop()
        told = self.prep.pull_progress(loop)
        model = await loop.run_in_executor(None, lambda: ModelStore().resolve(ref, quiet=True, progress=told))
        weights = self.weights_for(model.name)
        members: list[Member] = self.members()
        fp = await asyncio.to_thread(lambda: footprint(model.config(), weights, streams=self.streams))
        offers = [m.offer for m in members]
        home = self.home(members)
        curve = await asyncio.to_thread(_batch_curve, model.name, weights)
        plan = plan_pipeline(fp, offers, streams=self.streams, min_nodes=self.min_nodes, home=home, batch_curve=curve)
        held = await asyncio.to_thread(held_splits, model.name, weights)
        # an export at hand beats a marginally faster split
        chosen = prefer_held(
            fp, offers, plan, held, streams=self.streams, home=home, min_nodes=self.min_nodes, batch_curve=curve
        )
        if chosen is not plan:
            log.info("a split exported before is about as fast: %s instead of %s", chosen.ranges, plan.ranges)
        return Formed(model, weights, fp, members, chosen)

    async def async_adopt(self, ref: str) -> Formed | None:
        """Take over what runs already, or refit the nodes left onto an export held here (see
        :mod:`coordinator.service.takeover`); None when the model must be planned and exported afresh."""
        await asyncio.sleep(ADOPT_SETTLE_S)
        members: list[Member] = self.members()
        running: dict[str, Running] = {}
        for m in members:
            o = m.offer
            running.setdefault(o.node, Running(o.node, o.state, m.serving, m.holds, o.speed))
        weights = self.weights_for(ref)
        before = set(self.needed_before())  # refit only onto what the last coordinator ran or prepared
        held = [h for h in await asyncio.to_thread(held_exports, ref, weights) if h.export in before]
        a = adopt(list(running.values()), ref, self.home(members), held)
        if a is None:
            return None
        addresses = {m.offer.node: m.address for m in members}
        try:
            d = await copy_export(a.export, [addresses[n] for n in a.sources], self.transport)
            meta = json.loads((d / "export.json").read_text())
            ranges = [(int(x), int(y)) for x, y in meta["ranges"]]
        except (FetchError, OSError, ValueError, KeyError, TypeError) as e:
            log.warning("cannot take over the running plan (its export is not at hand: %s); planning afresh", e)
            return None
        if meta.get("options", {}).get("weights") != weights or len(ranges) != len(a.nodes):
            log.info("the running plan serves other weights or stages than wanted: planning afresh")
            return None
        if any(ranges[i] != r for i, r in a.reported):
            log.warning("the running stages report other layers than their export: planning afresh")
            return None
        model = await asyncio.to_thread(model_for, d, meta)
        fp = await asyncio.to_thread(lambda: footprint(model.config(), weights, streams=self.streams))
        stages = tuple(StagePlan(n, lo, hi, 0, 0.0) for n, (lo, hi) in zip(a.nodes, ranges, strict=True))
        return Formed(model, weights, fp, members, Plan(stages, 0.0, 0.0), a)

    async def async_replan(self, fp: Any, members: list[Member], model: str, weights: str) -> Plan | None:
        """The plan for the members heard now (None: none fits; the plan running stays)."""
        home = self.home(members)
        offers = [m.offer for m in members]
        curve = await asyncio.to_thread(_batch_curve, model, weights)
        try:
            plan = plan_pipeline(
                fp, offers, streams=self.streams, min_nodes=self.min_nodes, home=home, batch_curve=curve
            )
        except PlanError as e:
            log.warning("membership changed but no plan fits: %s", e)
            return None
        held = await asyncio.to_thread(held_splits, model, weights)
        return prefer_held(
            fp, offers, plan, held, streams=self.streams, home=home, min_nodes=self.min_nodes, batch_curve=curve
        )

    async def async_pull_weights(self, ref: str) -> LocalModel | None:
        """Adopted from an export alone: fetch the model's weights now, for the re-plans to come."""
        if ref not in REGISTRY:
            return None
        try:
            return await asyncio.to_thread(lambda: ModelStore().resolve(ref, quiet=True))
        except Exception as e:
            log.warning("cannot pull %s (a re-plan onto other nodes would need it): %s", ref, e)
            return None


def _batch_curve(model: str, weights: str) -> Curve | None:
    """The batch curve calibration measured here for ``model`` at ``weights`` (None: the stages
    have not run batched yet, so the plan assumes each stream steps on its own)."""
    return CalibrationStore().curve(calib_key(model, weights))
