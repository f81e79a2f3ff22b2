"""``lakeshard serve``: plan the split, export or reuse the shards, assign them, serve the API.

Two listeners: the data side (the ring's return websocket and the stage artifacts, reachable
by the agents) and the OpenAI-compatible API (127.0.0.1 unless configured otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from agent.api.events import EventHub
from agent.common import aio
from agent.common.limits import TOTAL_INFLIGHT
from agent.export.exporter import ExportOptions, ExportResult, cached_export, export_model
from agent.export.held import export_content_id
from agent.models.store import LocalModel
from agent.node.shutdown import describe, exit_now
from agent.protocol import MAX_FRAME
from agent.protocol.cluster_view import ClusterView, NodeInfo
from agent.protocol.events import Failover
from agent.runtime.tokenizer import ChatTokenizer
from agent.security import transport
from agent.serving.link import HEARTBEAT_S
from agent.serving.stage_host import OPTIONAL_FILES, STAGE_FILES
from coordinator.api.limits import Limiter, Limits
from coordinator.api.routes import ApiState, make_api_app
from coordinator.batching.scheduler import Scheduler
from coordinator.planning.calibration import CalibrationStore, fit_head_layers, propose, stage_time
from coordinator.planning.planner import PlanError, balanced_split, model_costs, split_from_cuts
from coordinator.ring.pipeline import Pipeline, PipelineError, StagePlacement
from coordinator.service.preparing import Preparer
from coordinator.speculative.decoding import SpecConfig
from coordinator.speculative.drafting import load_drafter

log = logging.getLogger(__name__)
STOP_GRACE_S = 0.3  # on SIGTERM: for streams in flight to get their last chunk out


# what an agent may fetch of a stage's export: its manifest and the files it lists
SERVED_FILES = frozenset({"manifest.json", *STAGE_FILES, *OPTIONAL_FILES})


@dataclass
class ServeConfig:
    nodes: list[str]
    model: LocalModel
    opts: ExportOptions
    split: list[int] | None = None
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    api_key: str | None = None
    # request limits per client (see coordinator/api/limits.py; the CLI resolves its defaults)
    api_limits: Limits = field(default_factory=lambda: Limits(total=TOTAL_INFLIGHT))
    data_host: str = "127.0.0.1"
    data_port: int = 0  # the ring's return and stage files (0: any free port)
    data_port_fallback: bool = False  # data_port taken: any free port instead (with a warning)
    advertise_host: str | None = None
    max_streams: int = 4
    link_delay_ms: float = 0.0
    link_mbps: float = 0.0
    wire_dtype: str = "f16"
    exact: bool = False
    term: int = 1
    quiet: bool = False
    api: bool = True  # False: the pipeline and scheduler only (benchmarks)
    ship_artifacts: bool = False
    draft: str | None = None  # speculative decoding: a draft model (name or path) or "lookup"
    draft_weights: str = "int4"
    draft_threads: int | None = None
    spec_k: int | None = None  # fixed draft length; None: chosen at run time
    spec_depth: int | None = None  # verify frames in flight per stream (2 = draft ahead); None: chosen at run time
    failover: bool = True  # re-plan over the surviving agents when one is lost, and resume
    ring_loop: bool = True  # plain decoding: the last stage feeds stage 0 itself (Fwd.auto)
    rebalance: bool = False  # re-plan once from measured stage times (see async_rebalance)
    # this machine's own agent (host:port), where it serves a stage: when that is the first
    # stage, the coordinator reaches it without crossing the network (no emulated WAN delay)
    home: str | None = None
    # the cluster event stream (None: one of its own, showing the pipeline's agents)
    events: EventHub | None = None
    cluster_id: str = "default"
    preparing: Preparer | None = None  # where its steps are told (None: one of its own, on its hub)
    ready: asyncio.Event = field(default_factory=asyncio.Event)


def plan_ranges(
    model: LocalModel, n_stages: int, split: Sequence[int] | None, head_layers: float | None = None
) -> list[tuple[int, int]]:
    if split:
        ranges = split_from_cuts(model.num_layers, split)
        if len(ranges) != n_stages:
            raise ValueError(f"--split gives {len(ranges)} stages for {n_stages} nodes")
        return ranges
    return balanced_split(model_costs(model.config(), head_layers), n_stages)


async def _usable(node: str, paused: set[str], timeout: float = 1.0) -> bool:
    """Whether the agent at ``node`` can take a stage now: it answers, and is not paused."""
    if node in paused and not await _not_paused(node, timeout):
        return False
    return await _reachable(node, timeout)


async def _not_paused(node: str, timeout: float) -> bool:
    try:
        async with (
            transport.current().session(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
            s.get(transport.current().url(node, "/v1/node")) as r,
        ):
            st = await r.json()
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return False
    return isinstance(st, dict) and st.get("state") != "paused"


async def _reachable(node: str, timeout: float = 1.0) -> bool:
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


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Coordinator:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.export: ExportResult | None = None
        self.pipeline: Pipeline | None = None
        self.scheduler: Scheduler | None = None
        self._runners: list[web.AppRunner] = []
        self.api_url = ""
        self.term = cfg.term
        self._exports: dict[str, list[Path]] = {}  # export id -> stage folders (served to agents)
        self._recover_lock = asyncio.Lock()
        self.recoveries: list[dict[str, object]] = []
        self._host = ""
        self._data_port = 0
        self._spare: asyncio.Task[None] | None = None
        self._rebalancer: asyncio.Task[None] | None = None
        self.nodes = list(cfg.nodes)  # the agents of the current plan
        self.replans: list[dict[str, object]] = []
        self._export_lock = asyncio.Lock()  # one export at a time (the fallback and a recovery share folders)
        self.calibration = CalibrationStore()
        self._tokenizer: asyncio.Future[ChatTokenizer] | None = None
        self.exported = 0  # exports its plans had to make (not found on disk; the fallback's not counted)
        self.export_id: str | None = None  # the running export's content id
        self.fallback_id: str | None = None  # the split for one node fewer, once prepared
        self.rebalances: list[dict[str, object]] = []
        self.node_ids: dict[str, str] = {}  # agent address -> node id, where the caller knows them
        self.node_devices: dict[str, str] = {}  # agent address -> the device its stage runs on (the planner's)
        self.hub = cfg.events if cfg.events is not None else EventHub(self.cluster_view)
        self._own_hub = cfg.events is None
        self.prep = cfg.preparing or Preparer(cfg.model.name, self.hub.publish)

    async def async_start(self) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self._data_port = cfg.data_port or _free_port(cfg.data_host)
        if cfg.data_port and cfg.data_port_fallback and not _port_free(cfg.data_host, cfg.data_port):
            self._data_port = _free_port(cfg.data_host)
            log.warning(
                "the coordinator's ring port %d is taken: using %d, which a firewall that opens only the "
                "configured ports will block (set serve.ring_port)",
                cfg.data_port,
                self._data_port,
            )
        self._host = cfg.advertise_host or (
            cfg.data_host if cfg.data_host not in ("0.0.0.0", "::") else socket.gethostname()
        )
        # node traffic (the ring's return, stage files): TLS with peer certificates when secure
        data_app = web.Application(client_max_size=MAX_FRAME, middlewares=[transport.peer_middleware])

        async def ring(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=MAX_FRAME, compress=False)
            await ws.prepare(request)
            async for m in ws:
                if m.type == aiohttp.WSMsgType.BINARY and self.pipeline is not None:
                    await self.pipeline.async_on_frame(m.data, from_ring=True)
            return ws

        async def artifact(request: web.Request) -> web.StreamResponse:
            dirs = self._exports.get(request.match_info["export"])
            if dirs is None:
                raise web.HTTPNotFound()
            i, name = int(request.match_info["stage"]), request.match_info["name"]
            if not (0 <= i < len(dirs)) or name not in SERVED_FILES:
                raise web.HTTPNotFound()
            return web.FileResponse(dirs[i] / name)

        data_app.router.add_get("/ring", ring)
        data_app.router.add_get(r"/artifacts/{export}/{stage:\d+}/{name}", artifact)
        await self._site(data_app, cfg.data_host, self._data_port, transport.current().server_ssl)
        self.pipeline = await self._build(cfg.nodes, cfg.split)
        spec = None
        if cfg.draft:
            draft = cfg.draft
            drafter = await loop.run_in_executor(
                None,
                lambda: load_drafter(
                    draft, cfg.model, weights=cfg.draft_weights, threads=cfg.draft_threads, quiet=cfg.quiet
                ),
            )
            spec = SpecConfig(drafter, k=cfg.spec_k, depth=cfg.spec_depth)
            log.info(
                "speculative decoding with %s, K %s", drafter.name, cfg.spec_k if cfg.spec_k is not None else "auto"
            )
        self.scheduler = Scheduler(self.pipeline, cfg.max_streams, spec, ring_loop=cfg.ring_loop)
        if cfg.failover:
            self.scheduler.recover = self.async_recover
            self._fallback_for(cfg.nodes)
        if cfg.rebalance:
            self._rebalancer = asyncio.create_task(self._auto_rebalance())
        if not cfg.api:
            self.prep.ready()
            cfg.ready.set()
            return
        assert self._tokenizer is not None
        tok = await self._tokenizer
        state = ApiState(
            model=cfg.model.name,
            tokenizer=tok,
            scheduler=self.scheduler,
            api_key=cfg.api_key,
            events=self.hub,
            served_by=self.served_by,
            limiter=Limiter(cfg.api_limits) if cfg.api_limits.any else None,
        )
        if self._own_hub:
            self.hub.start()
        api_port = cfg.api_port if cfg.api_port else _free_port(cfg.api_host)
        await self._site(make_api_app(state), cfg.api_host, api_port)
        self.api_url = f"http://{cfg.api_host}:{api_port}"
        self.prep.ready()
        cfg.ready.set()

    async def _build(self, nodes: Sequence[str], split: Sequence[int] | None = None) -> Pipeline:
        """Plan ``nodes`` into a pipeline, export (or reuse) the stages, assign them in ``self.term``."""
        cfg = self.cfg
        ranges = plan_ranges(cfg.model, len(nodes), split, self.calibration.get(self._calib_key()))
        loop = asyncio.get_running_loop()
        async with self._export_lock:
            if cached_export(cfg.model, ranges, cfg.opts) is None:
                self.exported += 1  # (a copy of the export on this disk is used as it is)
            told = self.prep.export_progress(loop, list(nodes), self.node_ids)
            export = await loop.run_in_executor(
                None, lambda: export_model(cfg.model, ranges, cfg.opts, quiet=cfg.quiet, progress=told)
            )
        self.export = export
        if self._tokenizer is None and cfg.api:  # loaded while the stages compile
            d = export.dir
            self._tokenizer = loop.run_in_executor(None, lambda: ChatTokenizer(d / "tokenizer", d / "config.json"))
        export_id = await loop.run_in_executor(None, export_content_id, export)
        self._exports[export_id] = export.stage_dirs()
        self.export_id = export_id
        pipeline = Pipeline(
            [
                StagePlacement(n, d, self.node_devices.get(n) or None)
                for n, d in zip(nodes, export.stage_dirs(), strict=True)
            ],
            export_id=export_id,
            return_url=transport.current().url(f"{self._host}:{self._data_port}", "/ring", ws=True),
            artifacts_url=transport.current().url(f"{self._host}:{self._data_port}", "/artifacts"),
            term=self.term,
            link_delay_ms=cfg.link_delay_ms,
            link_mbps=cfg.link_mbps,
            home_first=cfg.home is not None and nodes[0] == cfg.home,
            wire_dtype=cfg.wire_dtype,
            exact=cfg.exact,
            ship_artifacts=cfg.ship_artifacts,
        )
        try:
            async with self.prep.assigning(pipeline, self.node_ids):
                await pipeline.async_start()
        except BaseException:
            await pipeline.async_close()
            raise
        if self.api_url:  # a re-plan or a recovery (the first start is ready once its API is)
            self.prep.ready()
        return pipeline

    async def async_replan(self, nodes: Sequence[str], split: Sequence[int] | None = None) -> None:
        """Move to a new plan (a node joined, paused or came back) without dropping any stream.

        The new pipeline is built and assigned in a new term; agents it shares with the old one
        then refuse the old term, so every stream in flight stops after its current step and
        replays on the new pipeline: the plan changes only between steps, and no token is lost.
        """
        async with self._recover_lock:
            old = self.pipeline
            t0 = time.monotonic()
            self.term += 1
            new = await self._build(nodes, split)
            self.pipeline, self.nodes = new, list(nodes)
            if self.scheduler is not None:
                self.scheduler.set_pipeline(new)
            self.replans.append({"nodes": list(nodes), "term": self.term, "seconds": round(time.monotonic() - t0, 3)})
            self._fallback_for(nodes)
            if old is not None:
                old.mark_lost("-", f"re-planned onto {len(nodes)} node(s) in term {self.term}")
                await old.async_close()

    def _calib_key(self) -> str:
        return f"{self.cfg.model.name}|{self.cfg.opts.weights}"

    async def async_rebalance(self, min_gain: float = 0.05) -> dict[str, object] | None:
        """Fit the head's cost from the stages' measured step times; re-plan when that pays.

        The fit is stored for later plans. The move itself is ``async_replan``: streams in
        flight carry on, on the new split, without losing a token. Returns what was decided,
        or None when the stages have not measured enough yet (or the split is fixed).
        """
        cfg = self.cfg
        if cfg.split or len(self.nodes) < 2 or self.pipeline is None:
            return None
        async with transport.current().session(timeout=aiohttp.ClientTimeout(total=5)) as s:
            statuses = []
            for node in self.nodes:
                async with s.get(transport.current().url(node, "/v1/node")) as r:
                    statuses.append(await r.json())
        times = [stage_time(st) for st in statuses]
        if any(t is None for t in times):
            return None
        stages = [t for t in times if t is not None]
        head = fit_head_layers(stages)
        if head is None:
            return None
        self.calibration.update(self._calib_key(), head)
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
            await self.async_replan(self.nodes, [e for _, e in p.ranges[:-1]])
        self.rebalances.append(decision)
        return decision

    async def _auto_rebalance(self) -> None:
        """Once every stage has timed enough steps, rebalance once."""
        while True:
            await asyncio.sleep(5.0)
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                if await self.async_rebalance() is not None:
                    return

    def _fallback_for(self, nodes: Sequence[str]) -> None:
        """Have the split for one node fewer ready before it is needed (again after every re-plan)."""
        if self._spare is not None and not self._spare.done():
            self._spare.cancel()
        self.fallback_id = None
        if self.cfg.failover and len(nodes) > 1:
            self._spare = asyncio.create_task(self._prepare_fallback(len(nodes) - 1))

    async def _prepare_fallback(self, n: int) -> None:
        cfg = self.cfg
        try:
            ranges = plan_ranges(cfg.model, n, None, self.calibration.get(self._calib_key()))
            loop = asyncio.get_running_loop()
            async with self._export_lock:
                done = await loop.run_in_executor(None, lambda: export_model(cfg.model, ranges, cfg.opts, quiet=True))
            self.fallback_id = await loop.run_in_executor(None, export_content_id, done)
        except Exception as e:  # only a head start: recovery exports on demand otherwise
            log.info("could not prepare the %d-stage fallback: %s", n, e)

    async def async_recover(self, failed: Pipeline) -> None:
        """``failed`` lost a node: re-plan over the agents still reachable, in a new term.

        One recovery at a time; requests that fail together wait for the same one. Raises a
        PipelineError naming the reason when the survivors cannot carry the model.
        """
        async with self._recover_lock:
            if self.pipeline is not failed:
                return  # already replaced
            t0 = time.monotonic()
            live = [n for n in self.nodes if await _usable(n, failed.paused)]
            log.warning("re-planning over %d of %d agents after losing %s", len(live), len(self.nodes), failed.lost)
            if not live:
                why = "every agent is paused or gone" if failed.paused else "no agent is reachable any more"
                raise PipelineError(why, "cluster_lost")
            if len(live) > self.cfg.model.num_layers:
                live = live[: self.cfg.model.num_layers]
            self.term += 1
            try:
                new = await self._build(live)
            except (PipelineError, PlanError, OSError) as e:
                raise PipelineError(f"the remaining agents cannot carry the model: {e}", "cluster_lost") from e
            self.pipeline, self.nodes = new, live
            assert self.scheduler is not None
            self.scheduler.set_pipeline(new)
            seconds = round(time.monotonic() - t0, 3)
            self.recoveries.append({"lost": failed.lost, "nodes": live, "term": self.term, "seconds": seconds})
            self._fallback_for(live)
            lost = failed.lost or "?"
            self.hub.publish(Failover(time.time(), self.node_ids.get(lost, lost), seconds, self.term))
            failed.mark_lost(failed.lost or "?")
            await failed.async_close()

    def served_by(self) -> list[str]:
        """The nodes of the current plan, in stage order (ids where known, else addresses)."""
        return [self.node_ids.get(n, n) for n in self.nodes]

    def cluster_view(self) -> ClusterView:
        """A fixed pipeline's view (``lakeshard serve``): its agents, in stage order."""
        mans = [] if self.export is None else self.export.manifests
        ranges = [(m["stage"]["layer_start"], m["stage"]["layer_end"]) for m in mans]
        nodes, ring = [], []
        for i, addr in enumerate(self.nodes):
            node = addr.replace(":", "-").replace("[", "").replace("]", "")[:64]
            layers = tuple(ranges[i]) if i < len(ranges) else None
            nodes.append(NodeInfo(node, addr, addr, "standalone", "available", stage=i, layers=layers))
            ring.append(node)
        sched = self.scheduler
        return ClusterView(
            cluster=self.cfg.cluster_id,
            coordinator=None,
            term=self.term,
            model=self.cfg.model.name,
            service="serving" if self.pipeline is not None else "assigning",
            ring=tuple(ring),
            nodes=tuple(nodes),
            streams=sched.active if sched else 0,
            waiting=sched.waiting if sched else 0,
            preparing=self.prep.current,
        )

    @property
    def ring_port(self) -> int:
        """The port of the ring's return and the stage files (0 before it starts)."""
        return self._data_port

    async def _site(
        self, app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        # on shutdown, handlers get STOP_GRACE_S to send their streams' last (error) chunk
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=STOP_GRACE_S)
        await runner.setup()
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
        self._runners.append(runner)

    async def async_stop(self) -> None:
        """Stop serving: streams in flight end with a "shutting down" error, then the sites close.

        A spare export still running in a worker thread is not waited for (it is written to a
        temporary folder and renamed into place only when complete).
        """
        if self._own_hub:
            await self.hub.async_stop()
        for task in (self._rebalancer, self._spare):
            if task is not None and not task.done():
                task.cancel()
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.pipeline is not None:
            await self.pipeline.async_close()
        for r in reversed(self._runners):
            await r.cleanup()


def run_coordinator(cfg: ServeConfig) -> None:
    """``lakeshard serve``: serve until SIGINT or SIGTERM, then exit within about a second."""

    async def main() -> None:
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
            for t in (start, stopping):
                t.cancel()
            try:
                await asyncio.wait_for(coord.async_stop(), STOP_GRACE_S * 2)
            except (TimeoutError, Exception) as e:
                log.warning("shutdown cut short: %s", describe(e))  # (a TimeoutError's message is empty)

    # without waiting for worker threads (a spare export): their child processes end first
    try:
        aio.run(main())
    except KeyboardInterrupt:
        exit_now(130)
    exit_now(0)
