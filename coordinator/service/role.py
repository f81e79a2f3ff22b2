"""The elected coordinator's services inside the agent daemon: plan, assign, serve, publish.

While the local agent is the elected coordinator, this publishes the cluster's event stream
(:class:`agent.api.events.EventHub`: nodes, plan, failovers, streams). When the settings
also name a model to serve, it plans
a split over the nodes it hears (capacity-aware: free memory, speed, throttle state), hands
each agent its stage with the election's term (agents download only their own stage's files
over HTTP, sha256-verified and cached by content hash), and serves the OpenAI-compatible API
on 127.0.0.1. When the coordinator loses its role, the services stop. A node lost mid-way is
handled by the coordinator's failover (re-plan, replay, continue).

How the plan is come by is :mod:`coordinator.service.forming`; what the role tells of itself,
:mod:`coordinator.service.role_status`. Here: its life, from the plan to serving it, and the
watch over membership while it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from agent.api.events import EventHub
from agent.cluster.election import data_term
from agent.cluster.offers import Member
from agent.common.limits import TOTAL_INFLIGHT
from agent.export.exporter import ExportOptions
from agent.node.roles import ServicesSpec
from agent.protocol.cluster_view import ClusterView, NodeInfo
from agent.protocol.events import Takeover
from agent.security.transport import Transport
from coordinator.api.limits import Limits
from coordinator.planning.context import StageContext, cluster_context, plan_context
from coordinator.planning.planner import Plan
from coordinator.service import role_status
from coordinator.service.config import ServeConfig
from coordinator.service.coordinator import Coordinator
from coordinator.service.forming import Formed, Forming
from coordinator.service.preparing import Preparer

log = logging.getLogger(__name__)
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
        transport: Transport,  # how its links to the agents travel (the daemon's)
        nodes: Callable[[], list[NodeInfo]] = lambda: [],  # the same, as node maps show them
        cluster: str = "default",
        api_limits: Limits | None = None,  # per client (None: only the cap on requests in flight)
        needed_before: Callable[[], tuple[str, ...]] = tuple,  # the exports the last coordinator needed
        draft: str | None = None,  # speculative decoding: a draft model, "lookup" or "NAME+lookup"
        name: str | None = None,  # what node maps call this laptop (messages name it)
    ) -> None:
        self.model_ref, self.weights, self.api_port = model, weights, api_port
        self.draft, self.name = draft, name
        self.ring_port = ring_port
        self.streams, self.exact, self.term = streams, exact, term
        self.my_address = my_address
        self.transport = transport
        self.api_limits = api_limits or Limits(total=TOTAL_INFLIGHT)
        self.members = members
        self.coordinator: Coordinator | None = None
        self.plan: Plan | None = None
        self.context: tuple[StageContext, ...] = ()  # each stage's foretold KV pool and tokens
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
        self.forming = Forming(
            weights=weights,
            streams=streams,
            min_nodes=min_nodes,
            my_address=my_address,
            members=members,
            needed_before=needed_before,
            prep=self.prep,
            transport=transport,
        )

    async def async_start(self) -> None:
        """Publish the event stream; form and serve the pipeline when a model is set (in the
        background: it returns at once)."""
        await self.hub.async_start()
        if self.model_ref:
            self._task = asyncio.create_task(self._run())

    async def _run(self, take_over: bool = True) -> None:
        """Form the plan (take over what runs, else plan afresh), serve it, then watch membership."""
        ref = self.model_ref
        assert ref is not None
        t0 = time.monotonic()
        formed: Formed | None = None
        try:
            self.prep.planning()
            formed = await self.forming.async_adopt(ref) if take_over else None
            if formed is None:
                formed = await self.forming.async_plan(ref)
            self.plan = formed.plan
            await self._async_serve(formed)
            if formed.adoption is not None:
                self._took_over(formed, ref, round(time.monotonic() - t0, 3))
            await self._watch(formed.fp, _membership(formed.members))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if formed is not None and formed.adoption is not None and self.state != "serving":
                # e.g. a kept node died meanwhile
                log.warning("taking over the running plan failed (%s): planning afresh", e)
                if self.coordinator is not None:
                    await self.coordinator.async_stop()
                    self.coordinator = None
                await self._run(take_over=False)
                return
            self.state, self.error = "failed", str(e)
            self.prep.failed(self.error)
            log.error("cannot form the pipeline: %s", e)

    async def _async_serve(self, formed: Formed) -> None:
        """Assign ``formed``'s stages and serve its API."""
        self.addresses = {m.offer.node: m.address for m in formed.members}
        self.prep.model = formed.model.name  # (the reference may be a path)
        plan = formed.plan
        nodes = [self.addresses[n] for n in plan.nodes]
        self.context = plan_context(formed.fp, plan, [m.offer for m in formed.members])
        log.info("plan: %s; holds %d tokens of context", _describe(plan), cluster_context(self.context))
        self.state = "assigning"
        self.coordinator = Coordinator(self._serve_config(formed, nodes))
        self.coordinator.node_ids = {a: n for n, a in self.addresses.items()}
        self.coordinator.node_devices = _devices(plan, self.addresses)
        await self.coordinator.async_start()
        self.state = "serving"
        log.info(
            "serving %s on %d node(s); API %s/v1; limits: %s",
            formed.model.name,
            len(nodes),
            self.coordinator.api_url,
            self.api_limits.describe(),
        )

    def _serve_config(self, formed: Formed, nodes: list[str]) -> ServeConfig:
        return ServeConfig(
            nodes=nodes,
            model=formed.model,
            opts=ExportOptions(weights=formed.weights),
            split=[s.start for s in formed.plan.stages[1:]],
            api_port=self.api_port,
            api_port_fix="give this agent another --serve-api-port (or serve.api_port in its settings)",
            data_host="0.0.0.0",
            data_port=self.ring_port,
            data_port_fallback=True,  # another program (or agent) has it: a free port, with a warning
            advertise_host=self.my_address.rpartition(":")[0],
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
            transport=self.transport,
        )

    def _took_over(self, formed: Formed, ref: str, seconds: float) -> None:
        """Tell the cluster that a running plan was taken over (in ``seconds``), and what moved."""
        adoption, c = formed.adoption, self.coordinator
        assert adoption is not None and c is not None
        me = self.forming.home(formed.members) or ""
        self.adopted = {"kept": list(adoption.kept), "moved": list(adoption.moved), "seconds": seconds}
        kept, moved = len(adoption.kept), len(adoption.moved)
        self.hub.publish(Takeover(time.time(), me, self.term, kept, moved, seconds, c.exported > 0))
        log.info("took over the running plan in %.2f s: kept %s, moved %s", seconds, adoption.kept, adoption.moved)
        if formed.model.source == "export":  # to export other splits later, the weights are needed
            self._pulling = asyncio.create_task(self._pull_weights(ref))

    async def _pull_weights(self, ref: str) -> None:
        """Adopted from an export alone: fetch the model's weights now, for the re-plans to come."""
        model = await self.forming.async_pull_weights(ref)
        if model is not None and self.coordinator is not None:
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
            c = self.coordinator
            plan = await self.forming.async_replan(fp, members, c.cfg.model.name, c.cfg.opts.weights)
            if plan is not None:
                if _layout(plan) != _layout(self.plan):  # a new layout's pools (the running one's stay as told)
                    self.context = plan_context(fp, plan, [m.offer for m in members])
                await self._async_move(plan, members)

    async def _async_move(self, plan: Plan, members: list[Member]) -> None:
        """Serve ``plan`` from now on (unless a failover already moved there)."""
        c = self.coordinator
        assert c is not None
        self.addresses.update({m.offer.node: m.address for m in members})
        devices = _devices(plan, self.addresses)
        want = [self.addresses[n] for n in plan.nodes]
        if self._running() == (want, list(plan.ranges), [devices.get(a) for a in want]):
            self.plan = plan  # a failover (a node lost or paused) already moved there
            return
        c.node_ids.update({a: n for n, a in self.addresses.items()})
        c.node_devices = devices  # where the plan names no device, the agent chooses its own
        log.info("re-planning: %s", _describe(plan))
        self.state = "re-planning"
        await c.async_replan([self.addresses[n] for n in plan.nodes], [s.start for s in plan.stages[1:]])
        self.plan, self.state = plan, "serving"

    def _running(self) -> tuple[list[str], list[tuple[int, int]], list[str | None]]:
        """The agents (addresses), layer ranges and devices the coordinator runs now."""
        c = self.coordinator
        if c is None or c.export is None:
            return [], [], []
        ranges = [(m["stage"]["layer_start"], m["stage"]["layer_end"]) for m in c.export.manifests]
        devices = [p.device for p in c.pipeline.placements] if c.pipeline is not None else []
        return list(c.nodes), ranges, devices

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
        return role_status.not_ready(self)

    def cluster_view(self) -> ClusterView:
        """The cluster as node maps show it: the nodes heard, the plan, the service, the load."""
        return role_status.cluster_view(self)

    def status(self) -> dict[str, Any]:
        return role_status.status(self)

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


def _describe(plan: Plan) -> str:
    return ", ".join(
        f"{s.node}{f' ({s.device})' if s.device else ''} layers {s.start}..{s.end - 1}" for s in plan.stages
    )


def _devices(plan: Plan, addresses: dict[str, str]) -> dict[str, str]:
    """Agent address -> the device the plan runs its stage on (stages that name one)."""
    return {addresses[s.node]: s.device for s in plan.stages if s.device}


def _membership(members: list[Member]) -> frozenset[tuple[str, str]]:
    return frozenset((m.offer.node, m.offer.state) for m in members)


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
        transport=spec.transport,
    )


def _layout(plan: Plan | None) -> list[tuple[str, int, int, str]]:
    return [] if plan is None else [(s.node, s.start, s.end, s.device) for s in plan.stages]
