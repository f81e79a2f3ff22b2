"""The elected coordinator's services inside the agent daemon: plan, assign, serve, publish.

While the local agent is the elected coordinator, this publishes the cluster's event stream
(:class:`agent.api.events.EventHub`: nodes, plan, failovers, streams). When the settings
also name a model to serve, it plans
a split over the nodes it hears (capacity-aware: free memory, speed, throttle state), hands
each agent its stage with the election's term (agents download only their own stage's files
over HTTP, sha256-verified and cached by content hash), and serves the OpenAI-compatible API
on 127.0.0.1. When the coordinator loses its role, the services stop. A node lost mid-way is
handled by the coordinator's failover (re-plan, replay, continue).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from agent.api.events import EventHub
from agent.cluster.election import data_term
from agent.cluster.offers import Member
from agent.common.limits import TOTAL_INFLIGHT
from agent.export.exporter import ExportOptions
from agent.export.held import FetchError, HeldExports, async_fetch
from agent.models.registry import REGISTRY
from agent.models.store import LocalModel, ModelStore
from agent.node.roles import ServicesSpec
from agent.protocol.events import ClusterView, NodeInfo, Takeover
from agent.security import transport
from agent.security.errors import SecurityError
from coordinator.api.limits import Limits
from coordinator.planning.planner import Plan, PlanError, StagePlan, footprint, plan_pipeline, prefer_held
from coordinator.service.config import ServeConfig
from coordinator.service.coordinator import Coordinator
from coordinator.service.preparing import Preparer
from coordinator.service.takeover import Adoption, Held, Running, adopt

log = logging.getLogger(__name__)
SETTLE_S = 2.0  # after winning, let late peers' beats arrive before planning
ADOPT_SETTLE_S = 0.3  # taking over a running plan: the beats heard during the election are fresh
PROBE_WAIT_S = 20.0  # and give freshly started peers time to measure their speed
WATCH_S = 2.0  # how often membership is compared with the plan


class CoordinatorRole:
    def __init__(
        self,
        *,
        model: str | None,
        weights: str | None,
        api_port: int,
        streams: int,
        exact: bool,
        min_nodes: int = 1,  # the plan spreads over at least this many nodes, when as many are heard
        ring_port: int = 0,  # the ring's return and stage files (0: any free port)
        term: int,
        my_address: str,
        members: Callable[[], list[Member]],  # the nodes heard right now, this one included
        nodes: Callable[[], list[NodeInfo]] = lambda: [],  # the same, as node maps show them
        cluster: str = "default",
        api_limits: Limits | None = None,  # per client (None: only the cap on requests in flight)
        needed_before: Callable[[], tuple[str, ...]] = tuple,  # the exports the last coordinator needed
        draft: str | None = None,  # speculative decoding: a draft model, "lookup" or "NAME+lookup"
        name: str | None = None,  # what node maps call this laptop (messages name it)
    ) -> None:
        self.needed_before = needed_before
        self.model_ref, self.weights, self.api_port = model, weights, api_port
        self.draft, self.name = draft, name
        self.ring_port = ring_port
        self.streams, self.exact, self.term = streams, exact, term
        self.min_nodes = min_nodes
        self.my_address = my_address
        self.api_limits = api_limits or Limits(total=TOTAL_INFLIGHT)
        self.members = members
        self.coordinator: Coordinator | None = None
        self.plan: Plan | None = None
        self.addresses: dict[str, str] = {}
        self.error: str | None = None
        self.state = "planning" if model else "no model"
        self.started = time.time()
        self._task: asyncio.Task[None] | None = None
        self.nodes = nodes
        self.cluster = cluster
        self.hub = EventHub(self.cluster_view)
        self.prep = Preparer(model or "", self.hub.publish)  # its steps, on the event stream
        self.adopted: dict[str, Any] | None = None  # a running plan taken over: what was kept and moved
        self._pulling: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.hub.start()
        if self.model_ref:
            self._task = asyncio.create_task(self._run())

    async def _run(self, take_over: bool = True) -> None:
        ref = self.model_ref
        assert ref is not None
        t0 = time.monotonic()
        taken = None
        try:
            self.prep.planning()
            taken = await self._adopt(ref) if take_over else None
            if taken is None:
                model, weights, fp, members = await self._plan(ref)
            else:
                model, weights, fp, members, adoption = taken
            self.addresses = {m.offer.node: m.address for m in members}
            self.prep.model = model.name  # (the reference may be a path)
            assert self.plan is not None
            nodes = [self.addresses[n] for n in self.plan.nodes]
            log.info("plan: %s", _describe(self.plan))
            self.state = "assigning"
            host = self.my_address.rpartition(":")[0]
            cfg = ServeConfig(
                nodes=nodes,
                model=model,
                opts=ExportOptions(weights=weights),
                split=[s.start for s in self.plan.stages[1:]],
                api_port=self.api_port,
                data_host="0.0.0.0",
                data_port=self.ring_port,
                data_port_fallback=True,  # another program (or agent) has it: a free port, with a warning
                advertise_host=host,
                max_streams=self.streams,
                term=data_term(self.term),
                quiet=True,
                ship_artifacts=True,
                exact=self.exact,
                wire_dtype="f32" if self.exact else "f16",
                home=self.my_address,
                events=self.hub,
                preparing=self.prep,
                cluster_id=self.cluster,
                api_limits=self.api_limits,
                draft=self.draft,
            )
            self.coordinator = Coordinator(cfg)
            self.coordinator.node_ids = {a: n for n, a in self.addresses.items()}
            self.coordinator.node_devices = _devices(self.plan, self.addresses)
            await self.coordinator.async_start()
            self.state = "serving"
            log.info(
                "serving %s on %d node(s); API %s/v1; limits: %s",
                model.name,
                len(nodes),
                self.coordinator.api_url,
                self.api_limits.describe(),
            )
            if taken is not None:
                seconds = round(time.monotonic() - t0, 3)
                me = self._home(members) or ""
                exported = self.coordinator.exported > 0
                self.adopted = {"kept": list(adoption.kept), "moved": list(adoption.moved), "seconds": seconds}
                ev = Takeover(time.time(), me, self.term, len(adoption.kept), len(adoption.moved), seconds, exported)
                self.hub.publish(ev)
                log.info(
                    "took over the running plan in %.2f s: kept %s, moved %s", seconds, adoption.kept, adoption.moved
                )
                if model.source == "export":  # to export other splits later, the weights are needed
                    self._pulling = asyncio.create_task(self._pull_weights(ref))
            await self._watch(fp, _membership(members))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if taken is not None and self.state != "serving":  # e.g. a kept node died meanwhile
                log.warning("taking over the running plan failed (%s): planning afresh", e)
                if self.coordinator is not None:
                    await self.coordinator.async_stop()
                    self.coordinator = None
                await self._run(take_over=False)
                return
            self.state, self.error = "failed", str(e)
            self.prep.failed(self.error)
            log.error("cannot form the pipeline: %s", e)

    async def _plan(self, ref: str) -> tuple[LocalModel, str, Any, list[Member]]:
        """Plan afresh: wait for the nodes' beats and speeds, resolve (or pull) the model, split it."""
        await asyncio.sleep(SETTLE_S)
        t0 = time.monotonic()
        while time.monotonic() - t0 < PROBE_WAIT_S and not all(m.measured for m in self.members()):
            await asyncio.sleep(0.25)
        loop = asyncio.get_running_loop()
        told = self.prep.pull_progress(loop)
        model = await loop.run_in_executor(None, lambda: ModelStore().resolve(ref, quiet=True, progress=told))
        weights = self._weights(model.name)
        members: list[Member] = self.members()
        fp = await asyncio.to_thread(lambda: footprint(model.config(), weights, streams=self.streams))
        offers = [m.offer for m in members]
        home = self._home(members)
        plan = plan_pipeline(fp, offers, streams=self.streams, min_nodes=self.min_nodes, home=home)
        held = await asyncio.to_thread(_held_splits, model.name, weights)
        # an export at hand beats a marginally faster split
        self.plan = prefer_held(fp, offers, plan, held, streams=self.streams, home=home, min_nodes=self.min_nodes)
        if self.plan is not plan:
            log.info("a split exported before is about as fast: %s instead of %s", self.plan.ranges, plan.ranges)
        return model, weights, fp, members

    def _weights(self, name: str) -> str:
        spec = REGISTRY.get(name)
        return self.weights or (spec.default_weights if spec else "int4")

    async def _adopt(self, ref: str) -> tuple[LocalModel, str, Any, list[Member], Adoption] | None:
        """Take over what runs already, or refit the nodes left onto an export held here (see
        :mod:`coordinator.service.takeover`); None when the model must be planned and exported afresh."""
        await asyncio.sleep(ADOPT_SETTLE_S)
        members: list[Member] = self.members()
        running: dict[str, Running] = {}
        for m in members:
            o = m.offer
            running.setdefault(o.node, Running(o.node, o.state, m.serving, m.holds, o.speed))
        weights = self._weights(ref)
        before = set(self.needed_before())  # refit only onto what the last coordinator ran or prepared
        held = [h for h in await asyncio.to_thread(_held_exports, ref, weights) if h.export in before]
        a = adopt(list(running.values()), ref, self._home(members), held)
        if a is None:
            return None
        addresses = {m.offer.node: m.address for m in members}
        try:
            d = await copy_export(a.export, [addresses[n] for n in a.sources])
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
        model = await asyncio.to_thread(_model_for, d, meta)
        fp = await asyncio.to_thread(lambda: footprint(model.config(), weights, streams=self.streams))
        stages = tuple(StagePlan(n, lo, hi, 0, 0.0) for n, (lo, hi) in zip(a.nodes, ranges, strict=True))
        self.plan = Plan(stages, 0.0, 0.0)
        return model, weights, fp, members, a

    async def _pull_weights(self, ref: str) -> None:
        """Adopted from an export alone: fetch the model's weights now, for the re-plans to come."""
        if ref not in REGISTRY:
            return
        try:
            model = await asyncio.to_thread(lambda: ModelStore().resolve(ref, quiet=True))
        except Exception as e:
            log.warning("cannot pull %s (a re-plan onto other nodes would need it): %s", ref, e)
            return
        if self.coordinator is not None:
            self.coordinator.cfg.model = model

    async def _watch(self, fp: Any, seen: frozenset[tuple[str, str]]) -> None:
        """Re-plan when nodes join, leave or change throttle state (between steps; see async_replan)."""
        assert self.coordinator is not None and self.plan is not None
        while True:
            await asyncio.sleep(WATCH_S)
            members: list[Member] = self.members()
            now = _membership(members)
            if now == seen:
                continue
            left_only = now < seen  # departures are the failover's job (it re-plans when a stage is lost)
            seen = now
            if left_only:
                continue
            try:
                plan = plan_pipeline(
                    fp,
                    [m.offer for m in members],
                    streams=self.streams,
                    min_nodes=self.min_nodes,
                    home=self._home(members),
                )
            except PlanError as e:
                log.warning("membership changed but no plan fits: %s", e)
                continue
            c = self.coordinator
            held = await asyncio.to_thread(_held_splits, c.cfg.model.name, c.cfg.opts.weights)
            home = self._home(members)
            plan = prefer_held(
                fp, [m.offer for m in members], plan, held, streams=self.streams, home=home, min_nodes=self.min_nodes
            )
            self.addresses.update({m.offer.node: m.address for m in members})
            devices = _devices(plan, self.addresses)
            want = [self.addresses[n] for n in plan.nodes]
            if self._running() == (want, list(plan.ranges), [devices.get(a) for a in want]):
                self.plan = plan  # a failover (a node lost or paused) already moved there
                continue
            self.coordinator.node_ids.update({a: n for n, a in self.addresses.items()})
            self.coordinator.node_devices = devices  # where the plan names no device, the agent chooses its own
            log.info("re-planning: %s", _describe(plan))
            self.state = "re-planning"
            await self.coordinator.async_replan(
                [self.addresses[n] for n in plan.nodes], [s.start for s in plan.stages[1:]]
            )
            self.plan, self.state = plan, "serving"

    def _running(self) -> tuple[list[str], list[tuple[int, int]], list[str | None]]:
        """The agents (addresses), layer ranges and devices the coordinator runs now."""
        c = self.coordinator
        if c is None or c.export is None:
            return [], [], []
        ranges = [(m["stage"]["layer_start"], m["stage"]["layer_end"]) for m in c.export.manifests]
        devices = [p.device for p in c.pipeline.placements] if c.pipeline is not None else []
        return list(c.nodes), ranges, devices

    def _home(self, members: list[Member]) -> str | None:
        """This machine's node id, when its agent is among the members."""
        return next((m.offer.node for m in members if m.address == self.my_address), None)

    def needed_exports(self) -> list[str]:
        """The exports every member should hold: the one running, and the split for one node fewer."""
        c = self.coordinator
        return [e for e in (c.export_id, c.fallback_id) if e] if c is not None else []

    def api_base(self) -> str | None:
        """The OpenAI-compatible API's base URL (without /v1), once it answers."""
        c = self.coordinator
        return c.api_url if c is not None and c.api_url else None

    def not_ready(self) -> str | None:
        """Why the API cannot answer yet (None once it can)."""
        if self.api_base() is not None:
            return None
        if self.state == "no model":
            who = f"the coordinator {self.name}" if self.name else "the coordinator"
            return f"{who} serves no model: choose the cluster's model in Settings (or `lakeshard cluster model NAME`)"
        if self.state == "failed":
            return f"the coordinator could not form the pipeline: {self.error}"
        p = self.prep.current
        if p is not None and p.step not in ("ready", "failed"):
            return f"the coordinator is preparing {p.model}: {p.describe()}"
        return f"the coordinator is still forming the pipeline ({self.state})"

    def cluster_view(self) -> ClusterView:
        """The cluster as node maps show it: the nodes heard, the plan, the service, the load."""
        from dataclasses import replace

        c = self.coordinator
        where: dict[str, tuple[int, tuple[int, int]]] = {}
        if c is not None and c.export is not None and c.pipeline is not None:
            # what runs now (after a failover too): the coordinator's agents and their export
            ranges = [(m["stage"]["layer_start"], m["stage"]["layer_end"]) for m in c.export.manifests]
            ids = {a: n for n, a in self.addresses.items()}
            for i, (addr, r) in enumerate(zip(c.nodes, ranges, strict=False)):
                where[ids.get(addr, addr)] = (i, r)
        elif self.plan is not None:
            where = {st.node: (i, (st.start, st.end)) for i, st in enumerate(self.plan.stages)}
        ring = [n for n, _ in sorted(where.items(), key=lambda kv: kv[1][0])]
        nodes = []
        heard = self.nodes()
        me = heard[0].node if heard else None  # this node (the daemon lists itself first)
        for n in heard:
            stage, layers = where.get(n.node, (None, None))
            nodes.append(replace(n, stage=stage, layers=layers))
        sched = c.scheduler if c is not None else None
        return ClusterView(
            cluster=self.cluster,
            coordinator=me,
            term=self.term,
            model=self.model_ref,
            service=self.state,
            error=self.error,
            ring=tuple(ring),
            nodes=tuple(sorted(nodes, key=lambda n: n.node)),
            streams=sched.active if sched else 0,
            waiting=sched.waiting if sched else 0,
            preparing=self.prep.current,
        )

    def status(self) -> dict[str, Any]:
        c = self.coordinator
        stages = []
        if self.plan is not None:
            for s in self.plan.stages:
                stages.append(
                    {
                        "node": s.node,
                        "address": self.addresses.get(s.node),
                        "layers": [s.start, s.end],
                        "device": s.device or None,
                    }
                )
        return {
            "state": self.state,
            "model": self.model_ref,
            "term": self.term,
            "plan": stages,
            "api": f"{c.api_url}/v1" if c is not None and c.api_url else None,
            "ring_port": c.ring_port if c is not None and c.ring_port else None,  # for firewalls
            "api_limits": self.api_limits.describe(),
            "recoveries": list(c.recoveries) if c is not None else [],
            "replans": list(c.replans) if c is not None else [],
            "speculation": _speculation(c),
            "adopted": self.adopted,
            "needed_exports": self.needed_exports(),
            "exported": c.exported if c is not None else 0,
            "preparing": _preparing(self.prep),
            "error": self.error,
        }

    async def async_stop(self) -> None:
        await self.hub.async_stop()
        for task in (self._task, self._pulling):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self.coordinator is not None:
            await self.coordinator.async_stop()
            self.coordinator = None


async def copy_export(export: str, sources: list[str]) -> Path:
    """The folder of ``export`` on this node: held already, or copied from one of ``sources``."""
    held = HeldExports()
    h = (await asyncio.to_thread(held.scan, True)).get(export)
    if h is not None:
        return h.dir
    tr = transport.current()
    errors = []
    for src in sources:
        try:
            async with tr.session() as s:
                h = await async_fetch(s, tr.url(src, "/v1/exports"), export, held, {})
            return h.dir
        except (FetchError, aiohttp.ClientError, TimeoutError, SecurityError, ValueError) as e:
            errors.append(f"{src}: {e}")
    raise FetchError("; ".join(errors) or "no node holds it")


def _held_metas(model: str, weights: str) -> list[tuple[str, dict[str, Any]]]:
    """The complete exports of ``model`` with ``weights`` on this node's disk: (id, export.json)."""
    out = []
    for h in HeldExports().scan(True).values():
        try:
            meta = json.loads((h.dir / "export.json").read_text())
        except (OSError, ValueError):
            continue
        if meta.get("model", {}).get("name") == model and meta.get("options", {}).get("weights") == weights:
            out.append((h.id, meta))
    return out


def _held_exports(model: str, weights: str) -> list[Held]:
    return [Held(i, int(meta["stages"])) for i, meta in _held_metas(model, weights)]


def _held_splits(model: str, weights: str) -> list[list[tuple[int, int]]]:
    return [[(int(a), int(b)) for a, b in meta["ranges"]] for _, meta in _held_metas(model, weights)]


def _model_for(d: Path, meta: dict[str, Any]) -> LocalModel:
    """The store's model of this export when this node has it, else the model as the export
    describes it (config, tokenizer: enough to serve the export, not to export it again)."""
    info = meta["model"]
    have = ModelStore().get(info["name"])
    if have is not None and have.sha256 == info["sha256"]:
        return have
    return LocalModel.from_export(d)


def _describe(plan: Plan) -> str:
    return ", ".join(
        f"{s.node}{f' ({s.device})' if s.device else ''} layers {s.start}..{s.end - 1}" for s in plan.stages
    )


def _devices(plan: Plan, addresses: dict[str, str]) -> dict[str, str]:
    """Agent address -> the device the plan runs its stage on (stages that name one)."""
    return {addresses[s.node]: s.device for s in plan.stages if s.device}


def _membership(members: list[Member]) -> frozenset[tuple[str, str]]:
    return frozenset((m.offer.node, m.offer.state) for m in members)


def _speculation(c: Coordinator | None) -> dict[str, Any] | None:
    """Every answer's speculation so far (None: this coordinator has no draft)."""
    spec = c.scheduler.speculator if c is not None and c.scheduler is not None else None
    if spec is None:
        return None
    return {**spec.counters.summary(), "declined": spec.counters.declined}


def _preparing(prep: Preparer) -> str | None:
    """The preparation under way, in words (None: none, or it is over)."""
    p = prep.current
    return p.describe() if p is not None and p.step not in ("ready", "failed") else None


def make_services(spec: ServicesSpec) -> CoordinatorRole:
    """The ``lakeshard.coordinator`` entry point: the services a daemon runs while it coordinates
    (:mod:`agent.node.roles`)."""
    return CoordinatorRole(
        model=spec.model,
        weights=spec.weights,
        draft=spec.draft,
        name=spec.name,
        api_port=spec.api_port,
        ring_port=spec.ring_port,
        streams=spec.streams,
        min_nodes=spec.min_nodes,
        api_limits=Limits(spec.api_rate, spec.api_concurrency, TOTAL_INFLIGHT),
        exact=spec.exact,
        term=spec.term,
        my_address=spec.my_address,
        members=spec.members,
        nodes=spec.nodes,
        cluster=spec.cluster,
        needed_before=spec.needed_before,
    )
