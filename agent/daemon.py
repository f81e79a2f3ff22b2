"""The agent daemon: what runs on every laptop, left running.

One process, one event loop, four parts:

* the stage server (:mod:`agent.server`) on the public port (TCP): websockets for the ring;
* peer messages on the same port number (UDP): beats, votes and fencing (:mod:`agent.elector`);
* mDNS advertisement and browsing (:mod:`agent.discovery`), unless switched off, plus the
  static peers from the settings;
* the local status API on 127.0.0.1: ``/v1/node``, ``/v1/cluster`` and
  ``POST /v1/node/state`` (pause / resume sharing: the tray's switch).

``standalone`` keeps only the stage server (a fixed pipeline driven by ``lakeshard serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import psutil
from aiohttp import web

from agent import __version__
from agent.config import Settings
from agent.discovery import MIB, Advert, Discovery
from agent.election import Role, Timing
from agent.elector import Elector, LocalNode
from agent.identity import TermStore, node_id
from agent.paths import log_dir
from agent.protocol.control import STATES
from agent.server import make_app
from agent.stage_host import StageHost

log = logging.getLogger(__name__)
EPOCH_BITS = 20


def data_term(election_term: int) -> int:
    """The data-plane term of an election term: a coordinator re-plans (after a lost node) in
    ``data_term(T) + 1``, ``+ 2`` ..., all below the next election's, so fencing holds across both."""
    return election_term << EPOCH_BITS


@dataclass(frozen=True)
class DaemonOptions:
    host: str = "0.0.0.0"
    device: str = "AUTO"
    threads: int | None = None
    spin_ms: float = 50.0
    head_help: str = "auto"  # "auto", "on" or "off"
    standalone: bool = False
    timing: Timing = field(default_factory=Timing)


class AgentDaemon:
    def __init__(self, settings: Settings, opts: DaemonOptions) -> None:
        self.settings, self.opts = settings, opts
        self.node = node_id()
        # standalone agents take their term from a 'serve' coordinator, not from an election
        self.store = TermStore(persist=not opts.standalone)
        self.host = StageHost(device=opts.device, threads=opts.threads, spin_ms=opts.spin_ms, head_help=opts.head_help)
        self.host.term_seen = data_term(self.store.state.term)
        self.me = LocalNode(
            node=self.node,
            cluster=settings.cluster_id,
            port=settings.port,
            version=__version__,
            mem_total=psutil.virtual_memory().total,
            mem_free=lambda: int(psutil.virtual_memory().available),
        )
        self.elector: Elector | None = None
        self.discovery: Discovery | None = None
        self.capacity: dict[str, Any] | None = None
        self.api_port = settings.api_port
        self.started = time.time()
        self._advertised: Advert | None = None
        self._runners: list[web.AppRunner] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.services: Any = None  # coordinator.role.CoordinatorRole while this node coordinates

    # -- lifecycle -----------------------------------------------------------------------------
    async def async_start(self) -> None:
        public = make_app(self.host, status=self.node_status)
        self.me.port = await self._serve(public, self.opts.host, self.settings.port)
        local = web.Application()
        local[DAEMON] = self
        local.router.add_get("/v1/node", _node)
        local.router.add_get("/v1/cluster", _cluster)
        local.router.add_post("/v1/node/state", _set_state)
        self.api_port = await self._serve(local, "127.0.0.1", self.settings.api_port)
        if not self.opts.standalone:
            self.elector = Elector(self.me, self.settings, self.store, self.opts.timing)
            self.elector.on_term = self._on_term
            await self.elector.async_start(self.opts.host)
            if self.settings.mdns:
                self.discovery = Discovery(
                    self.settings.cluster_id,
                    self.advert,
                    self._on_advert,
                    self.elector.on_goodbye,
                    self.settings.interface,
                )
                await self.discovery.async_start()
                self._advertised = self.advert()
        self._tasks.append(asyncio.create_task(self._probe()))
        self._tasks.append(asyncio.create_task(self._refresh()))
        if self.elector is not None and self.settings.serve_model:
            self._tasks.append(asyncio.create_task(self._coordinate()))

    async def _serve(self, app: web.Application, host: str, port: int) -> int:
        """Serve ``app``; returns the port it got (``port`` 0: any free one)."""
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self._runners.append(runner)
        await web.TCPSite(runner, host, port).start()
        return int(runner.addresses[-1][1])

    async def async_shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.services is not None:
            await self.services.async_stop()
        if self.discovery is not None:
            await self.discovery.async_close()  # says goodbye
        if self.elector is not None:
            await self.elector.async_shutdown()
        for r in reversed(self._runners):
            await r.cleanup()

    # -- keeping what we offer current -----------------------------------------------------------
    async def _probe(self) -> None:
        from agent import capacity

        try:
            cap = await asyncio.to_thread(capacity.probe)
        except Exception as e:
            log.warning("capacity probe failed: %s", e)
            return
        self.capacity = cap.to_dict()
        self.me.score = cap.speed_score
        self.me.devices = tuple(cap.kinds()) or ("CPU",)
        log.info("capacity: %s, speed %.1f GFLOP/s on %s", ",".join(self.me.devices), cap.speed_score, cap.best_device)

    async def _refresh(self) -> None:
        """Re-advertise over mDNS when what we offer changed noticeably."""
        while True:
            await asyncio.sleep(1.0)
            if self.discovery is None:
                continue
            ad, old = self.advert(), self._advertised
            if old is None or _differs(old, ad):
                with contextlib.suppress(Exception):
                    await self.discovery.async_update()
                self._advertised = ad

    async def _coordinate(self) -> None:
        """Run the coordinator's services while this node is the elected coordinator."""
        from coordinator.role import CoordinatorRole

        e = self.elector
        assert e is not None
        while True:
            await asyncio.sleep(0.25)
            leading = e.role is Role.COORDINATOR
            term = self.store.state.term
            if self.services is not None and (not leading or self.services.term != term):
                log.info("coordinator services stop (term %d)", self.services.term)
                await self.services.async_stop()
                self.services = None
            if leading and self.services is None:
                s = self.settings
                self.services = CoordinatorRole(
                    model=str(s.serve_model),
                    weights=s.serve_weights,
                    api_port=s.serve_api_port,
                    streams=s.serve_streams,
                    exact=s.serve_exact,
                    term=term,
                    my_address=f"{self._my_ip()}:{self.me.port}",
                    members=self._members,
                )
                self.services.start()

    def _my_ip(self) -> str:
        from agent.discovery import local_addresses

        ips = local_addresses(self.settings.interface)
        return ips[0] if ips else "127.0.0.1"

    def _members(self) -> list[Any]:
        from coordinator.planner import NodeOffer
        from coordinator.role import Member

        e = self.elector
        assert e is not None
        me = self.me
        out = [
            Member(
                NodeOffer(me.node, me.mem_free(), max(me.score, 1.0), me.state),
                f"{self._my_ip()}:{me.port}",
                me.score > 0,
            )
        ]
        now = time.monotonic()
        for p in e.peers.values():
            b = p.beat
            if b is None or now - p.last_heard >= e.timing.peer_timeout_s:
                continue
            offer = NodeOffer(p.node, b.mem_free, max(b.score, 1.0), b.state)
            out.append(Member(offer, f"{p.addr[0]}:{b.port}", b.score > 0))
        return out

    def advert(self) -> Advert:
        m = self.me
        return Advert(m.node, m.cluster, m.version, m.devices, m.mem_free(), m.score, m.state, m.port)

    def _on_advert(self, ad: Advert) -> None:
        if self.elector is not None:
            self.elector.on_advert(ad.node, (ad.addresses[0], ad.port))

    def _on_term(self, term: int) -> None:
        self.host.term_seen = max(self.host.term_seen, data_term(term))

    # -- status ----------------------------------------------------------------------------------
    def node_status(self) -> dict[str, Any]:
        e = self.elector
        return {
            "node": self.node,
            "cluster": self.settings.cluster_id,
            "version": __version__,
            "state": self.me.state,
            "role": str(e.role) if e else "standalone",
            "term": self.store.state.term,
            "coordinator": e.leader() if e else None,
            "port": self.me.port,
            "api_port": self.api_port,
            "mdns": self.discovery is not None,
            "mem_total": self.me.mem_total,
            "mem_free": self.me.mem_free(),
            "speed_score": self.me.score,
            "devices": list(self.me.devices),
            "capacity": self.capacity,
            "stage": self.host.status(),
            "log_dir": str(log_dir()),
            "started": self.started,
        }

    def cluster_status(self) -> dict[str, Any]:
        if self.elector is None:
            return {"node": self.node, "role": "standalone", "peers": [], "coordinator": None, "term": 0}
        st = self.elector.status()
        st["services"] = self.services.status() if self.services is not None else None
        return st


DAEMON = web.AppKey("daemon", AgentDaemon)


def _differs(a: Advert, b: Advert) -> bool:
    if (a.state, a.devices, round(a.score, 1)) != (b.state, b.devices, round(b.score, 1)):
        return True
    return abs(a.mem_free - b.mem_free) > max(256 * MIB, a.mem_free // 10)


async def _node(request: web.Request) -> web.Response:
    return web.json_response(request.app[DAEMON].node_status())


async def _cluster(request: web.Request) -> web.Response:
    return web.json_response(request.app[DAEMON].cluster_status())


async def _set_state(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return web.json_response({"error": 'the body must be JSON like {"state": "paused"}'}, status=400)
    state = body.get("state") if isinstance(body, dict) else None
    if state not in STATES:
        return web.json_response({"error": f"state must be one of {', '.join(STATES)}"}, status=400)
    if state != d.me.state:
        log.info("state %s -> %s (from the status API)", d.me.state, state)
        d.me.state = state
    return web.json_response(d.node_status())


async def _main(settings: Settings, opts: DaemonOptions) -> None:
    d = AgentDaemon(settings, opts)
    await d.async_start()
    mode = "standalone" if opts.standalone else f"cluster {settings.cluster_id}"
    print(
        f"lakeshard agent {d.node} ({mode}) listening on {opts.host}:{d.me.port}, status API on 127.0.0.1:{d.api_port}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # Windows
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await d.async_shutdown()


def run_daemon(settings: Settings, opts: DaemonOptions) -> None:
    from agent.aio import run

    run(_main(settings, opts))


@contextlib.asynccontextmanager
async def running(settings: Settings, opts: DaemonOptions) -> AsyncIterator[AgentDaemon]:
    """A daemon inside the current event loop (for tests on real loopback sockets)."""
    d = AgentDaemon(settings, opts)
    await d.async_start()
    try:
        yield d
    finally:
        await d.async_shutdown()
