"""``lakeshard serve``: plan the split, export or reuse the shards, assign them, serve the API.

Two listeners: the data side (the ring's return websocket and the stage artifacts, reachable
by the agents) and the OpenAI-compatible API (127.0.0.1 unless configured otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from agent import aio
from agent.export.exporter import ExportOptions, ExportResult, export_model
from agent.link import HEARTBEAT_S
from agent.models.store import LocalModel
from agent.protocol import MAX_FRAME
from agent.runtime.tokenizer import ChatTokenizer
from coordinator.api import ApiState, make_api_app
from coordinator.drafting import load_drafter
from coordinator.pipeline import Pipeline, StagePlacement
from coordinator.planner import balanced_split, model_costs, split_from_cuts
from coordinator.scheduler import Scheduler
from coordinator.speculative import SpecConfig

log = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    nodes: list[str]
    model: LocalModel
    opts: ExportOptions
    split: list[int] | None = None
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    api_key: str | None = None
    data_host: str = "127.0.0.1"
    data_port: int = 0
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
    ring_loop: bool = True  # plain decoding: the last stage feeds stage 0 itself (Fwd.auto)
    ready: asyncio.Event = field(default_factory=asyncio.Event)


def plan_ranges(model: LocalModel, n_stages: int, split: Sequence[int] | None) -> list[tuple[int, int]]:
    if split:
        ranges = split_from_cuts(model.num_layers, split)
        if len(ranges) != n_stages:
            raise ValueError(f"--split gives {len(ranges)} stages for {n_stages} nodes")
        return ranges
    return balanced_split(model_costs(model.config()), n_stages)


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

    async def async_start(self) -> None:
        cfg = self.cfg
        ranges = plan_ranges(cfg.model, len(cfg.nodes), cfg.split)
        loop = asyncio.get_running_loop()
        self.export = await loop.run_in_executor(
            None, lambda: export_model(cfg.model, ranges, cfg.opts, quiet=cfg.quiet)
        )
        export_id = hashlib.sha256(str(self.export.dir).encode()).hexdigest()[:16]

        data_port = cfg.data_port or _free_port(cfg.data_host)
        host = cfg.advertise_host or (cfg.data_host if cfg.data_host not in ("0.0.0.0", "::") else socket.gethostname())
        data_app = web.Application(client_max_size=MAX_FRAME)
        self.pipeline = Pipeline(
            [StagePlacement(n, d) for n, d in zip(cfg.nodes, self.export.stage_dirs(), strict=True)],
            export_id=export_id,
            return_url=f"ws://{host}:{data_port}/ring",
            artifacts_url=f"http://{host}:{data_port}/artifacts",
            term=cfg.term,
            link_delay_ms=cfg.link_delay_ms,
            link_mbps=cfg.link_mbps,
            wire_dtype=cfg.wire_dtype,
            exact=cfg.exact,
            ship_artifacts=cfg.ship_artifacts,
        )
        pipeline = self.pipeline
        stage_dirs = self.export.stage_dirs()

        async def ring(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=MAX_FRAME, compress=False)
            await ws.prepare(request)
            async for m in ws:
                if m.type == aiohttp.WSMsgType.BINARY:
                    await pipeline.async_on_frame(m.data)
            return ws

        async def artifact(request: web.Request) -> web.StreamResponse:
            if request.match_info["export"] != export_id:
                raise web.HTTPNotFound()
            i, name = int(request.match_info["stage"]), request.match_info["name"]
            if not (0 <= i < len(stage_dirs)) or name not in ("manifest.json", "model.xml", "model.bin"):
                raise web.HTTPNotFound()
            return web.FileResponse(stage_dirs[i] / name)

        data_app.router.add_get("/ring", ring)
        data_app.router.add_get(r"/artifacts/{export}/{stage:\d+}/{name}", artifact)
        await self._site(data_app, cfg.data_host, data_port)
        await self.pipeline.async_start()
        spec = None
        if cfg.draft:
            draft = cfg.draft
            drafter = await loop.run_in_executor(
                None,
                lambda: load_drafter(
                    draft, cfg.model, weights=cfg.draft_weights, threads=cfg.draft_threads, quiet=cfg.quiet
                ),
            )
            spec = SpecConfig(drafter, k=cfg.spec_k)
            log.info(
                "speculative decoding with %s, K %s", drafter.name, cfg.spec_k if cfg.spec_k is not None else "auto"
            )
        self.scheduler = Scheduler(self.pipeline, cfg.max_streams, spec, ring_loop=cfg.ring_loop)
        if not cfg.api:
            cfg.ready.set()
            return
        export_dir = self.export.dir
        tok = await loop.run_in_executor(
            None, lambda: ChatTokenizer(export_dir / "tokenizer", export_dir / "config.json")
        )
        state = ApiState(model=cfg.model.name, tokenizer=tok, scheduler=self.scheduler, api_key=cfg.api_key)
        api_port = cfg.api_port if cfg.api_port else _free_port(cfg.api_host)
        await self._site(make_api_app(state), cfg.api_host, api_port)
        self.api_url = f"http://{cfg.api_host}:{api_port}"
        cfg.ready.set()

    async def _site(self, app: web.Application, host: str, port: int) -> None:
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        self._runners.append(runner)

    async def async_stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.pipeline is not None:
            await self.pipeline.async_close()
        for r in reversed(self._runners):
            await r.cleanup()


def run_coordinator(cfg: ServeConfig) -> None:
    async def main() -> None:
        coord = Coordinator(cfg)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        try:
            await coord.async_start()
            print(f"lakeshard: serving {cfg.model.name} on {len(cfg.nodes)} nodes; API {coord.api_url}/v1", flush=True)
            await stop.wait()
        finally:
            await coord.async_stop()

    try:
        aio.run(main())
    except KeyboardInterrupt:
        sys.exit(130)
