"""The coordinator of one pipeline: plan the split, export or reuse the shards, assign them,
serve the API. ``lakeshard serve`` runs one (:mod:`coordinator.service.serve`); so does the
elected coordinator inside an agent daemon (:mod:`coordinator.service.role`).

Two listeners: the data side (the ring's return websocket and the stage artifacts, reachable
by the agents: :mod:`coordinator.service.listener`) and the OpenAI-compatible API (127.0.0.1
unless configured otherwise). Each other concern has a collaborator of its own: the exports
(:mod:`coordinator.service.exports`), the failover (:mod:`coordinator.service.failover`),
rebalancing (:mod:`coordinator.service.rebalance`) and the cluster view
(:mod:`coordinator.service.view`). What they share lives here: the plan now running (its
nodes, term and pipeline), and the one lock under which a plan changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from aiohttp import web

from agent.api.events import EventHub
from agent.common.ports import ListenError, bind_error, listen_error, port_taken
from agent.export.exporter import ExportResult
from agent.protocol.cluster_view import ClusterView
from agent.runtime.tokenizer import ChatTokenizer
from coordinator.api.limits import Limiter
from coordinator.api.routes import make_api_app
from coordinator.api.state import ApiState
from coordinator.batching.batcher import Batcher
from coordinator.batching.scheduler import Scheduler
from coordinator.planning.calibration import CalibrationStore
from coordinator.ring.pipeline import Pipeline, StagePlacement
from coordinator.service.config import ServeConfig, plan_ranges
from coordinator.service.exports import StageExports
from coordinator.service.failover import Failover
from coordinator.service.listener import DataListener, async_serve_site, free_port
from coordinator.service.preparing import Preparer
from coordinator.service.rebalance import Rebalancer
from coordinator.service.view import served_by, standalone_view
from coordinator.speculative.decoding import SpecConfig
from coordinator.speculative.drafting import load_drafter

log = logging.getLogger(__name__)


class Coordinator:
    """One pipeline's coordinator: its plan, scheduler and listeners, from start to stop."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.pipeline: Pipeline | None = None
        self.scheduler: Scheduler | Batcher | None = None
        self.api_url = ""
        self.term = cfg.term
        self.nodes = list(cfg.nodes)  # the agents of the current plan
        self.replans: list[dict[str, object]] = []
        self.plan_lock = asyncio.Lock()  # one plan change at a time (a re-plan, a recovery)
        self.calibration = CalibrationStore()
        self.node_ids: dict[str, str] = {}  # agent address -> node id, where the caller knows them
        self.node_devices: dict[str, str] = {}  # agent address -> the device its stage runs on (the planner's)
        self.hub = cfg.events if cfg.events is not None else EventHub(self.cluster_view)
        self._own_hub = cfg.events is None
        self.prep = cfg.preparing or Preparer(cfg.model.name, self.hub.publish)
        self.exports = StageExports(cfg)
        self.listener = DataListener(
            cfg.data_host,
            cfg.data_port,
            port_fallback=cfg.data_port_fallback,
            advertise_host=cfg.advertise_host,
            on_frame=self._async_on_ring_frame,
            stage_dirs=self.exports.stage_dirs,
            transport=cfg.transport,
        )
        self.failover = Failover(self)
        self.rebalancer = Rebalancer(self)
        self._tokenizer: asyncio.Future[ChatTokenizer] | None = None
        self._api: web.AppRunner | None = None

    async def async_start(self) -> None:
        """Listen for the agents, plan and assign the first pipeline, then serve the API (whose
        port is checked first: a taken one fails the start before any export or assignment)."""
        cfg = self.cfg
        if cfg.api and cfg.api_port and (taken := bind_error(cfg.api_host, cfg.api_port)) is not None:
            raise api_port_error(cfg.api_host, cfg.api_port, taken, cfg.api_port_fix)
        await self.listener.async_start()
        self.pipeline = await self._async_build(cfg.nodes, cfg.split)
        self.scheduler = await self._async_scheduler(self.pipeline)
        if cfg.failover:
            self.scheduler.recover = self.failover.async_recover
            await self.failover.async_spare_for(cfg.nodes)
        if cfg.rebalance:
            await self.rebalancer.async_start()
        if cfg.api:
            await self._async_start_api(self.scheduler)
        self.prep.ready()
        cfg.ready.set()

    async def _async_scheduler(self, pipeline: Pipeline) -> Scheduler | Batcher:
        """Continuous batching where every stage is paged (unless configured off); else one
        stream per step. Either speculates where a draft is configured."""
        cfg = self.cfg
        if cfg.batching and pipeline.capacity() is not None:
            spec = await self._async_spec()
            return Batcher(pipeline, cfg.batch_streams, cfg.batch_queue, spec, prefix_cache=cfg.prefix_cache)
        return Scheduler(pipeline, cfg.max_streams, await self._async_spec(), ring_loop=cfg.ring_loop)

    async def _async_spec(self) -> SpecConfig | None:
        """Speculative decoding's settings, its drafter loaded (None: no draft configured)."""
        cfg = self.cfg
        if not cfg.draft:
            return None
        draft = cfg.draft
        drafter = await asyncio.get_running_loop().run_in_executor(
            None,
            lambda: load_drafter(
                draft, cfg.model, weights=cfg.draft_weights, threads=cfg.draft_threads, quiet=cfg.quiet
            ),
        )
        log.info("speculative decoding with %s, K %s", drafter.name, cfg.spec_k if cfg.spec_k is not None else "auto")
        return SpecConfig(drafter, k=cfg.spec_k, depth=cfg.spec_depth)

    async def _async_start_api(self, scheduler: Scheduler | Batcher) -> None:
        cfg = self.cfg
        assert self._tokenizer is not None
        state = ApiState(
            model=cfg.model.name,
            tokenizer=await self._tokenizer,
            scheduler=scheduler,
            api_key=cfg.api_key,
            events=self.hub,
            served_by=self.served_by,
            limiter=Limiter(cfg.api_limits) if cfg.api_limits.any else None,
        )
        if self._own_hub:
            await self.hub.async_start()
        api_port = cfg.api_port if cfg.api_port else free_port(cfg.api_host)
        try:
            self._api = await async_serve_site(make_api_app(state), cfg.api_host, api_port)
        except OSError as e:  # taken since it was checked
            raise api_port_error(cfg.api_host, api_port, e, cfg.api_port_fix) from None
        self.api_url = f"http://{cfg.api_host}:{api_port}"

    async def _async_on_ring_frame(self, data: bytes) -> None:
        if self.pipeline is not None:
            await self.pipeline.async_on_frame(data, from_ring=True)

    async def _async_build(self, nodes: Sequence[str], split: Sequence[int] | None = None) -> Pipeline:
        """Plan ``nodes`` into a pipeline, export (or reuse) the stages, assign them in ``self.term``."""
        cfg = self.cfg
        ranges = plan_ranges(cfg.model, len(nodes), split, self.calibration.get(cfg.calib_key))
        loop = asyncio.get_running_loop()
        export = await self.exports.async_export(ranges, self.prep.export_progress(loop, list(nodes), self.node_ids))
        if self._tokenizer is None and cfg.api:  # loaded while the stages compile
            d = export.dir
            self._tokenizer = loop.run_in_executor(None, lambda: ChatTokenizer(d / "tokenizer", d / "config.json"))
        pipeline = self._pipeline(nodes, export, await self.exports.async_serve(export))
        try:
            async with self.prep.assigning(pipeline, cfg.transport, self.node_ids):
                await pipeline.async_start()
        except BaseException:
            await pipeline.async_close()
            raise
        if self.api_url:  # a re-plan or a recovery (the first start is ready once its API is)
            self.prep.ready()
        return pipeline

    def _pipeline(self, nodes: Sequence[str], export: ExportResult, export_id: str) -> Pipeline:
        cfg = self.cfg
        return Pipeline(
            [
                StagePlacement(n, d, self.node_devices.get(n) or None)
                for n, d in zip(nodes, export.stage_dirs(), strict=True)
            ],
            export_id=export_id,
            return_url=self.listener.return_url,
            artifacts_url=self.listener.artifacts_url,
            transport=cfg.transport,
            term=self.term,
            link_delay_ms=cfg.link_delay_ms,
            link_mbps=cfg.link_mbps,
            home_first=cfg.home is not None and nodes[0] == cfg.home,
            wire_dtype=cfg.wire_dtype,
            exact=cfg.exact,
            ship_artifacts=cfg.ship_artifacts,
        )

    async def async_move_to(self, nodes: Sequence[str], split: Sequence[int] | None = None) -> Pipeline:
        """Build and assign a plan over ``nodes`` in a new term, and send new steps there; the
        old pipeline is the caller's to close. Hold :attr:`plan_lock` around it."""
        self.term += 1
        new = await self._async_build(nodes, split)
        self.pipeline, self.nodes = new, list(nodes)
        if self.scheduler is not None:
            self.scheduler.set_pipeline(new)
        await self.failover.async_spare_for(nodes)
        return new

    async def async_replan(self, nodes: Sequence[str], split: Sequence[int] | None = None) -> None:
        """Move to a new plan (a node joined, paused or came back) without dropping any stream.

        The new pipeline is built and assigned in a new term; agents it shares with the old one
        then refuse the old term, so every stream in flight stops after its current step and
        replays on the new pipeline: the plan changes only between steps, and no token is lost.
        """
        async with self.plan_lock:
            old = self.pipeline
            t0 = time.monotonic()
            await self.async_move_to(nodes, split)
            self.replans.append({"nodes": list(nodes), "term": self.term, "seconds": round(time.monotonic() - t0, 3)})
            if old is not None:
                old.mark_lost("-", f"re-planned onto {len(nodes)} node(s) in term {self.term}")
                await old.async_close()

    async def async_rebalance(self, min_gain: float = 0.05) -> dict[str, object] | None:
        """Re-plan from the stages' measured times when that pays (see :class:`Rebalancer`)."""
        return await self.rebalancer.async_rebalance(min_gain)

    async def async_recover(self, failed: Pipeline) -> None:
        """Re-plan after ``failed`` lost a node (see :class:`Failover`)."""
        await self.failover.async_recover(failed)

    # what the daemon's role, the benchmarks and the tests read
    @property
    def export(self) -> ExportResult | None:
        return self.exports.current

    @property
    def export_id(self) -> str | None:
        """The running export's content id."""
        return self.exports.current_id

    @property
    def exported(self) -> int:
        """Exports its plans had to make (not found on disk; the fallback's not counted)."""
        return self.exports.exported

    @property
    def fallback_id(self) -> str | None:
        """The split for one node fewer, once prepared."""
        return self.failover.fallback_id

    @property
    def recoveries(self) -> list[dict[str, object]]:
        return self.failover.recoveries

    @property
    def rebalances(self) -> list[dict[str, object]]:
        return self.rebalancer.rebalances

    @property
    def ring_port(self) -> int:
        """The port of the ring's return and the stage files (0 before it starts)."""
        return self.listener.port

    def served_by(self) -> list[str]:
        """The nodes of the current plan, in stage order (ids where known, else addresses)."""
        return served_by(self)

    def cluster_view(self) -> ClusterView:
        """A fixed pipeline's view (``lakeshard serve``): its agents, in stage order."""
        return standalone_view(self)

    async def async_stop(self) -> None:
        """Stop serving: streams in flight end with a "shutting down" error, then the sites close.

        A spare export still running in a worker thread is not waited for (it is written to a
        temporary folder and renamed into place only when complete).
        """
        if self._own_hub:
            await self.hub.async_stop()
        await self.rebalancer.async_stop()
        await self.failover.async_stop()
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.pipeline is not None:
            await self.pipeline.async_close()
        if self._api is not None:
            await self._api.cleanup()
        await self.listener.async_stop()


def api_port_error(host: str, port: int, e: OSError, fix: str = ServeConfig.api_port_fix) -> ListenError:
    """The API cannot listen on ``host:port``: one line, with what fixes it."""
    if port_taken(e):
        return listen_error("the API", host, port, e, f"another program holds it: {fix}")
    return listen_error("the API", host, port, e, "is the API's host an address of this machine?")
