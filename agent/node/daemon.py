"""The agent daemon: what runs on every laptop, left running.

One process, one event loop, four parts:

* the stage server (:mod:`agent.serving.endpoint`) on the public port (TCP): websockets for the ring,
  and the cluster identity routes (:mod:`agent.security.routes`: the CA, joining, revocations);
  mutual TLS with this node's cluster credentials (:mod:`agent.security.transport`), plaintext
  only when told (``--insecure``), with a loud warning. ``lakeshard agent`` constructs a daemon
  only once this node is in a cluster (:mod:`agent.node.unjoined`, which also serves its local API);
* peer messages on the same port number (UDP): beats, votes and fencing (:mod:`agent.cluster.elector`);
* mDNS advertisement and browsing (:mod:`agent.cluster.discovery`), unless switched off, plus the
  static peers from the settings;
* the local status API on 127.0.0.1 (:mod:`agent.api.local`): this node, the cluster, the
  pause switch, the settings, and the coordinator's chat API and event stream forwarded from
  wherever the coordinator is (:mod:`agent.api.gateway`), which is all a tray needs.

While this node is the elected coordinator it also runs the coordinator's services
(:mod:`coordinator.service.role`): the event hub always, the pipeline and API when a model is set:
this node's override (``serve.model``), else the cluster's model setting, a signed document
every member holds (:mod:`agent.cluster.settings_gossip`); when a newer one names another model, the
services restart and plan it.

``standalone`` keeps only the stage server (a fixed pipeline driven by ``lakeshard serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import psutil
from aiohttp import web

from agent import __version__
from agent.api.cluster_model import add_settings_route
from agent.api.gateway import Target, add_member_routes
from agent.api.local import make_local_app, serve_local
from agent.cluster.discovery import MIB, Advert, Discovery
from agent.cluster.election import Role, Timing, data_term
from agent.cluster.elector import Elector, LocalNode
from agent.cluster.fencing import CoordinatorFence
from agent.cluster.node_state import TermStore, node_id
from agent.cluster.offers import Member, NodeOffer
from agent.cluster.revocation_gossip import RevocationGossip
from agent.cluster.settings_gossip import Effective, SettingsGossip, effective
from agent.common.config import Settings, ring_port_for
from agent.common.paths import agent_state_dir, log_dir
from agent.export import held as held_exports
from agent.node.replication import ExportCopies, HeardPeer
from agent.node.roles import NoCoordinator, Services, ServicesSpec, load_factory
from agent.node.shutdown import bounded
from agent.protocol.events import NodeInfo
from agent.security import transport
from agent.security.datagrams import for_credentials
from agent.security.routes import add_cluster_routes, membership
from agent.serving.endpoint import make_app
from agent.serving.stage_host import StageHost
from agent.throttle.controller import Contribution
from agent.throttle.thermal import temperature_c

log = logging.getLogger(__name__)
# settings a running agent takes at once, and those it takes at its next start
LIVE_KEYS = ("preferred", "exclude", "min_coordinator_memory", "log_level", "name")
RESTART_KEYS = (
    "cluster_id",
    "port",
    "api_port",
    "mdns",
    "static_peers",
    "interface",
    "serve_model",
    "serve_weights",
    "serve_api_port",
    "serve_ring_port",
    "serve_streams",
    "serve_min_nodes",
    "serve_api_rate",
    "serve_api_concurrency",
    "models_dir",
    "insecure",
)


INSECURE_WHY = "--insecure, or 'insecure: true' in the settings"
# on shutdown (within agent.node.shutdown.SHUTDOWN_S in all): the coordinator's services and the mDNS
# goodbye, side by side (the services' own listeners give streams 2 x 0.3 s for their last chunk)
SERVICES_STOP_S = 0.7
LISTENERS_STOP_S = 0.3  # then the stage server and local API, side by side


@dataclass(frozen=True)
class DaemonOptions:
    host: str = "0.0.0.0"
    device: str = "AUTO"
    threads: int | None = None
    spin_ms: float = 50.0
    head_help: str = "auto"  # "auto", "on" or "off"
    standalone: bool = False
    throttle: bool = True  # follow the throttle policy (settings: throttle.enabled); off for local clusters
    insecure: bool = False  # plaintext node links (never without it: no credentials is an error)
    timing: Timing = field(default_factory=Timing)


class AgentDaemon:
    def __init__(self, settings: Settings, opts: DaemonOptions, config_path: Any = None) -> None:
        self.settings, self.opts = settings, opts
        self.config_path = config_path  # the settings file it was started with (None: the default)
        # node links: mutual TLS when this node has cluster credentials (chosen once, here)
        self.transport = transport.use(transport.choose(opts.insecure, why=INSECURE_WHY))
        creds = self.transport.creds
        if creds is not None and settings.cluster_id != creds.cluster_id:
            if settings.cluster_id != "default":
                log.warning(
                    "the settings' cluster_id %r is not this node's cluster: using %s (from its certificate)",
                    settings.cluster_id,
                    creds.cluster_id,
                )
            settings = replace(settings, cluster_id=creds.cluster_id)
            self.settings = settings
        folder = agent_state_dir(settings.port)  # several agents on one machine: one each
        self.node = node_id(folder)
        if creds is not None and creds.node_id != self.node:
            log.warning(
                "this agent is node %s but its certificate names node %s (made for another port?): members "
                "refuse its election datagrams and will not accept it as their coordinator; join again with a new "
                "token ('cluster join --force')",
                self.node,
                creds.node_id,
            )
        # standalone agents take their term from a 'serve' coordinator, not from an election
        self.store = TermStore(folder, persist=not opts.standalone)
        self.fence = CoordinatorFence(lambda: self.store.state)
        self.host = StageHost(device=opts.device, threads=opts.threads, spin_ms=opts.spin_ms, head_help=opts.head_help)
        self.host.term_seen = data_term(self.store.state.term)
        self.held = held_exports.HeldExports()  # whole exports on this disk (a stage assigned from one: no download)
        self.host.held = self.held
        self.me = LocalNode(
            node=self.node,
            cluster=settings.cluster_id,
            port=settings.port,
            version=__version__,
            mem_total=psutil.virtual_memory().total,
            mem_free=lambda: int(psutil.virtual_memory().available),
            name=settings.name or socket.gethostname()[:64] or None,
        )
        self.copies = ExportCopies(self.held, self.me, self.host, self._heard_peers, self._needed_exports)
        self.elector: Elector | None = None
        self.discovery: Discovery | None = None
        self.gossip: RevocationGossip | None = None
        # the model the cluster serves: a signed, versioned document every member holds (gossiped)
        self.cluster_settings = SettingsGossip(self.transport, settings.cluster_id, self.node, on_change=self._held)
        self.cluster_settings.load()
        self._serving: tuple[str | None, str | None, str | None] | None = None  # the services' model
        self._warmed: tuple[str | None, str | None, str | None] | None = None  # its config read once
        self.capacity: dict[str, Any] | None = None
        self.api_port = settings.api_port
        self.serves_local_api = True
        self.started = time.time()
        self.stopping = False  # shutting down (the gateway then lets answers end as they end)
        self._advertised: Advert | None = None
        self._runners: list[web.AppRunner] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.services: Services | None = None  # while this node coordinates
        self.no_services: str | None = None  # why this agent cannot coordinate (no coordinator installed)
        self.session: aiohttp.ClientSession | None = None  # forwarding to the coordinator
        # the user's switch and the throttle policy: this node's state, applied to its stage
        self.contrib = Contribution(
            self.me,
            self.host.throttle,
            lambda: self.settings.throttle,
            enabled=opts.throttle and settings.throttle.enabled,
        )
        self._tokens_seen = (time.monotonic(), 0)

    # -- lifecycle -----------------------------------------------------------------------------
    async def async_start(self) -> None:
        self.session = transport.current().session()
        # elected agents with credentials take assignments only from the coordinator of their term
        fence = self.fence.async_check if self.transport.secure and not self.opts.standalone else None
        public = make_app(self.host, self.node_status, [transport.peer_middleware], fence)
        add_cluster_routes(public)  # cluster identity: the CA, joining, the revocation list
        log.info("%s", membership(self.node))
        if not self.opts.standalone:
            add_member_routes(public, self)
            held_exports.add_routes(public, self.held, self._may_fetch)
            add_settings_route(public, self.cluster_settings)  # what peers fetch (members only)
        try:
            self.me.port = await self._serve(public, self.opts.host, self.settings.port, transport.current().server_ssl)
        except OSError as e:
            raise OSError(
                f"the data port {self.opts.host}:{self.settings.port} is taken ({e.strerror or e}); another agent may "
                "be running: give this one another --port (or 'port' in the settings)"
            ) from None
        if self.serves_local_api:  # else agent.node.unjoined.LocalAgent serves it (and set api_port)
            self.api_port = await serve_local(self._runners, make_local_app(self), self.settings.api_port)
        if not self.opts.standalone:
            signed = for_credentials(self.transport.creds)  # election datagrams: signed with credentials
            self.elector = Elector(self.me, self.settings, self.store, self.opts.timing, signed)
            self.elector.on_term = self._on_term
            if self.transport.secure:  # members adopt the newest revocation list their peers' beats announce
                self.gossip = RevocationGossip(self.transport)
                self._tasks.append(asyncio.create_task(self.gossip.run()))
            self.elector.on_beat_heard = self._on_beat  # and the newest cluster settings
            self._tasks.append(asyncio.create_task(self.cluster_settings.run()))
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
        if self.contrib.enabled:
            self._tasks.append(asyncio.create_task(self.contrib.run()))
        if self.elector is not None:
            self._tasks.append(asyncio.create_task(self._coordinate()))
            self._tasks.append(asyncio.create_task(self.copies.run()))

    async def _serve(
        self, app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None
    ) -> int:
        """Serve ``app``; returns the port it got (``port`` 0: any free one)."""
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self._runners.append(runner)
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
        return int(runner.addresses[-1][1])

    async def async_shutdown(self) -> None:
        """Stop in the order the other nodes notice, every step bounded (see :mod:`agent.node.shutdown`).

        The election first: a coordinator's last beat says it stepped down, and with the beats
        stopped the peers count this node gone within ``peer_timeout_s``. Then, side by side, the
        coordinator's services (streams in flight end with an error chunk) and the mDNS goodbye;
        then the listeners (a peer that never answers a websocket close cannot hold the exit up)."""
        self.stopping = True
        for t in self._tasks:
            t.cancel()
        if self.elector is not None:
            await bounded(self.elector.async_shutdown(), 0.1, "the election's last beat")
        steps = []
        if self.services is not None:
            steps.append(bounded(self.services.async_stop(), SERVICES_STOP_S, "the coordinator's services"))
        if self.discovery is not None:
            steps.append(bounded(self.discovery.async_close(), SERVICES_STOP_S, "the mDNS goodbye"))
        await asyncio.gather(*steps)
        await asyncio.gather(*(bounded(r.cleanup(), LISTENERS_STOP_S, "a listener") for r in self._runners))
        if self.session is not None:
            await bounded(self.session.close(), 0.1, "the HTTP session")

    # -- keeping what we offer current -----------------------------------------------------------
    async def _probe(self) -> None:
        from agent.node import capacity

        try:
            cap = await asyncio.to_thread(capacity.probe, requested=self.opts.device)
        except Exception as e:
            log.warning("capacity probe failed: %s", e)
            return
        self.capacity = cap.to_dict()
        self.me.offers = cap.offers()
        self.me.score = cap.speed_score
        self.me.devices = tuple(cap.kinds()) or ("CPU",)
        log.info(
            "capacity: %s",
            ", ".join(f"{o.name} {o.score:.1f} GFLOP/s, {o.mem_free / 2**30:.1f} GB free" for o in self.me.offers)
            or "no device measured",
        )

    async def _refresh_device_memory(self) -> None:
        """Re-read the free memory of devices that have their own (a discrete GPU: a property read on
        the Core the stage runs on); the others offer the system's figure, read fresh for every beat."""
        if not any(o.own_memory for o in self.me.offers):
            return
        from agent.node import capacity
        from agent.runtime.device import core

        def read() -> dict[str, int]:
            c = core()
            return {o.name: capacity.query_memory(c, o.name).free for o in self.me.offers if o.own_memory}

        try:
            free = await asyncio.to_thread(read)
        except Exception as e:
            log.debug("device memory not read: %s", e)
            return
        self.me.offers = tuple(replace(o, mem_free=free.get(o.name, o.mem_free)) for o in self.me.offers)

    async def _refresh(self) -> None:
        """Keep what we offer current; re-advertise over mDNS when it changed noticeably."""
        while True:
            await asyncio.sleep(1.0)
            self._measure()
            await self._refresh_device_memory()
            self.contrib.expire()
            if self.discovery is None:
                continue
            ad, old = self.advert(), self._advertised
            if old is None or _differs(old, ad):
                with contextlib.suppress(Exception):
                    await self.discovery.async_update()
                self._advertised = ad

    def _measure(self) -> None:
        t0, n0 = self._tokens_seen
        now, n = time.monotonic(), self.host.positions
        self.me.tok_s = round(max(0.0, n - n0) / max(now - t0, 1e-3), 1)
        self._tokens_seen = (now, n)
        self.me.temp_c = temperature_c()
        self.me.next_rtt_ms = None if self.host.next_rtt_ms is None else round(self.host.next_rtt_ms, 3)

    def set_state(self, state: str, for_s: float | None = None) -> None:
        """The user's switch: pause, limit or resume contributing (``for_s``: it resets after that)."""
        self.contrib.set_manual(state, for_s)

    def apply_settings(self, new: Settings, before: Settings | None = None) -> list[str]:
        """Take new settings from the settings file (``before``: what it said until now).

        The election's settings apply at once; the rest take effect at the next start, and the
        names of those that changed are returned."""
        was = before or self.settings
        restart = [k for k in RESTART_KEYS if getattr(was, k) != getattr(new, k)]
        live = {k: getattr(new, k) for k in LIVE_KEYS}
        self.settings = replace(self.settings, **live)
        if new.name != was.name:
            self.me.name = new.name or socket.gethostname()[:64] or None
        if self.elector is not None:
            self.elector.settings = self.settings
        return restart

    async def _coordinate(self) -> None:
        """Run the coordinator's services while this node is the elected coordinator."""
        try:
            make_services = await asyncio.to_thread(load_factory)  # (imports torch: seconds, off the loop)
        except (NoCoordinator, ImportError) as err:
            self.no_services = str(err)
            log.error("this agent cannot coordinate: %s", err)
            return
        e = self.elector
        assert e is not None
        while True:
            await asyncio.sleep(0.25)
            leading = e.role is Role.COORDINATOR
            term = self.store.state.term
            want = self.effective_model()
            moved = self.services is not None and leading and self.services.term == term and self._serving != want.key
            if moved:  # a newer cluster setting was adopted (or set here): re-plan onto its model
                log.info("the model to serve is now %s (%s): the services restart", want.model or "none", want.why)
            if self.services is not None and (not leading or self.services.term != term or moved):
                log.info("coordinator services stop (term %d)", self.services.term)
                await self.services.async_stop()
                self.services = None
            if want.model and want.key != self._warmed:
                # the first read of a model's config (and tokenizer) imports transformers' code for
                # it: seconds, on a busy laptop enough to miss beats and lose the election, so off the
                # loop, and on every member ahead of time, so that taking over never waits for it
                self._warmed = want.key
                await asyncio.to_thread(_read_config, want.model, self.held)
                continue  # (still the coordinator, of the same term? the next round sees)
            if leading and self.services is None:
                s = self.settings
                self._serving = want.key
                self.services = make_services(
                    ServicesSpec(
                        model=want.model,
                        weights=want.weights,
                        draft=want.draft,
                        name=self.display_name(),
                        api_port=s.serve_api_port,
                        ring_port=s.serve_ring_port if s.serve_ring_port is not None else ring_port_for(self.me.port),
                        streams=s.serve_streams,
                        min_nodes=s.serve_min_nodes,
                        api_rate=s.serve_api_rate,
                        api_concurrency=s.serve_api_concurrency,
                        exact=s.serve_exact,
                        term=term,
                        my_address=f"{self._my_ip()}:{self.me.port}",
                        members=self._members,
                        nodes=self.node_infos,
                        cluster=s.cluster_id,
                        needed_before=lambda: self.copies.cluster_needs,
                    )
                )
                self.services.start()

    def _my_ip(self) -> str:
        from agent.cluster.discovery import local_addresses

        ips = local_addresses(self.settings.interface)
        return ips[0] if ips else "127.0.0.1"

    def _may_fetch(self, request: web.Request) -> bool:
        """Who may copy this node's exports: with TLS, whoever the peer middleware let in (a member's
        certificate); in plaintext, loopback and live peers' addresses."""
        if self.transport.secure:
            return True
        ip = request.remote or ""
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(ip).is_loopback:
                return True
        return self.is_member_address(ip)

    def _needed_exports(self) -> list[str]:
        """While this node coordinates: the exports every member should hold (running, fallback)."""
        sv = self.services
        return sv.needed_exports() if sv is not None else []

    def _heard_peers(self) -> list[HeardPeer]:
        """Live peers with their latest beats, the coordinator first."""
        e = self.elector
        if e is None:
            return []
        now, leader = time.monotonic(), e.leader()
        out = [
            HeardPeer(p.node, f"{p.addr[0]}:{p.beat.port}", p.beat)
            for p in e.peers.values()
            if p.beat is not None and now - p.last_heard < e.timing.peer_timeout_s
        ]
        return sorted(out, key=lambda h: h.node != leader)

    def _members(self) -> list[Member]:
        e = self.elector
        assert e is not None
        me = self.me
        here = f"{self._my_ip()}:{me.port}"
        mem = min(me.mem_free(), me.mem_total)
        serving, holds = self.host.report(), me.exports
        out = [
            Member(
                NodeOffer(me.node, o.mem_free, max(o.score, 1.0), me.state, o.name), here, me.score > 0, serving, holds
            )
            for o in me.device_offers(mem)
        ] or [Member(NodeOffer(me.node, mem, max(me.score, 1.0), me.state), here, me.score > 0, serving, holds)]
        now = time.monotonic()
        for p in e.peers.values():
            b = p.beat
            if b is None or now - p.last_heard >= e.timing.peer_timeout_s:
                continue
            there = f"{p.addr[0]}:{b.port}"
            offers = [NodeOffer(p.node, o.mem_free, max(o.score, 1.0), b.state, o.name) for o in b.offers]
            for offer in offers or [NodeOffer(p.node, b.mem_free, max(b.score, 1.0), b.state)]:
                out.append(Member(offer, there, b.score > 0, b.serving, b.exports))
        return out

    def node_infos(self) -> list[NodeInfo]:
        """Every node this one hears right now (itself first), as node maps show them."""
        e = self.elector
        me, st = self.me, self.host.status()
        role = str(e.role) if e else "standalone"
        out = [
            NodeInfo(
                node=me.node,
                name=me.name or me.node,
                address=f"{self._my_ip()}:{me.port}",
                role=role,
                state=me.state,
                reason=me.reason,
                devices=me.devices,
                mem_free=min(me.mem_free(), me.mem_total),
                mem_total=me.mem_total,
                score=me.score,
                temp_c=me.temp_c,
                tok_s=me.tok_s,
                rtt_ms=0.0,
                next_rtt_ms=me.next_rtt_ms,
                stage=st["stage"],
                layers=tuple(st["layers"]) if st["layers"] else None,
                version=me.version,
            )
        ]
        if e is None:
            return out
        now = time.monotonic()
        for p in e.peers.values():
            b = p.beat
            if b is None or now - p.last_heard >= e.timing.peer_timeout_s:
                continue
            out.append(
                NodeInfo(
                    node=p.node,
                    name=b.name or p.node,
                    address=f"{p.addr[0]}:{b.port}",
                    role=b.role,
                    state=b.state,
                    reason=b.reason,
                    devices=b.devices,
                    mem_free=b.mem_free,
                    mem_total=b.mem_total,
                    score=b.score,
                    temp_c=b.temp_c,
                    tok_s=b.tok_s,
                    rtt_ms=None if p.rtt_ms is None else round(p.rtt_ms, 2),
                    next_rtt_ms=b.next_rtt_ms,
                    version=b.version,
                )
            )
        return out

    def coordinator_target(self) -> Target | None:
        """Where the coordinator's services are (see :mod:`agent.api.gateway`); None during an election."""
        e = self.elector
        if e is None:
            return None
        leader = e.leader()
        if leader is None:
            return None
        if leader == self.node:
            sv = self.services
            if sv is None:
                return None
            return Target(self.node, api=sv.api_base(), hub=sv.hub, not_ready=sv.not_ready())
        p = e.peers.get(leader)
        if p is None or p.beat is None:
            return None
        return Target(leader, peer=f"{p.addr[0]}:{p.beat.port}")

    def is_member_address(self, ip: str) -> bool:
        """Whether ``ip`` is a live peer's (the public port serves the coordinator to members only)."""
        e = self.elector
        if e is None:
            return False
        with contextlib.suppress(ValueError):
            addr = ipaddress.ip_address(ip)
            if addr.version == 6 and addr.ipv4_mapped is not None:
                ip = str(addr.ipv4_mapped)
        now = time.monotonic()
        return any(p.addr[0] == ip and now - p.last_heard < e.timing.peer_timeout_s for p in e.peers.values())

    def advert(self) -> Advert:
        m = self.me
        return Advert(m.node, m.cluster, m.version, m.devices, m.mem_free(), m.score, m.state, m.port, reason=m.reason)

    def _on_advert(self, ad: Advert) -> None:
        if self.elector is not None:
            self.elector.on_advert(ad.node, (ad.addresses[0], ad.port))

    def _on_term(self, term: int) -> None:
        self.host.term_seen = max(self.host.term_seen, data_term(term))

    def _on_beat(self, beat: Any, src: tuple[str, int]) -> None:
        """Every beat the elector takes: gossip of the revocation list and the cluster settings."""
        if self.gossip is not None:
            self.gossip.on_beat(beat, src)
        self.cluster_settings.on_beat(beat, src)

    # -- the model the cluster serves ------------------------------------------------------------
    def _held(self, doc: Any) -> None:
        self.me.settings = doc.key if doc is not None else None  # what beats announce

    def model_settings(self) -> SettingsGossip:
        return self.cluster_settings

    def effective_model(self) -> Effective:
        """What this node serves when elected: its override (serve.model), else the cluster's."""
        s = self.settings
        return effective(s.serve_model, s.serve_weights, self.cluster_settings.held)

    def serve_override(self) -> tuple[str | None, str | None]:
        return self.settings.serve_model, self.settings.serve_weights

    def display_name(self) -> str:
        return self.me.name or self.node

    # -- status ----------------------------------------------------------------------------------
    def node_status(self) -> dict[str, Any]:
        e = self.elector
        return {
            "node": self.node,
            "name": self.me.name,
            "cluster": self.settings.cluster_id,
            "version": __version__,
            "model": self.effective_model().to_json(),  # what it serves when elected, and why
            "state": self.me.state,
            "reason": self.me.reason,
            "paused_until": self.contrib.manual_until,
            "throttle": self.contrib.status(),
            "tok_s": self.me.tok_s,
            "temp_c": self.me.temp_c,
            "role": str(e.role) if e else "standalone",
            "term": self.store.state.term,
            "coordinator": e.leader() if e else None,
            "port": self.me.port,
            "api_port": self.api_port,
            "mdns": self.discovery is not None,
            "links": self.links,
            "mem_total": self.me.mem_total,
            "mem_free": self.me.mem_free(),
            "speed_score": self.me.score,
            "devices": list(self.me.devices),
            "devices_detail": [
                {"name": o.name, "score": o.score, "mem_free": o.mem_free, "own_memory": o.own_memory}
                for o in self.me.device_offers(min(self.me.mem_free(), self.me.mem_total))
            ],
            "capacity": self.capacity,
            "stage": self.host.status(),
            "exports": self.copies.status(),
            "log_dir": str(log_dir()),
            "config_file": str(self.config_path) if self.config_path else None,
            "started": self.started,
            "peers": self._live_peers(),
        }

    def _live_peers(self) -> int:
        e = self.elector
        if e is None:
            return 0
        now = time.monotonic()
        return sum(1 for p in e.peers.values() if now - p.last_heard < e.timing.peer_timeout_s)

    @property
    def links(self) -> str:
        """How this node's links to other nodes travel: "TLS" (mutual, its cluster's certificates) or "PLAINTEXT"."""
        return "TLS" if self.transport.secure else "PLAINTEXT"

    def cluster_status(self) -> dict[str, Any]:
        if self.elector is None:
            return {"node": self.node, "role": "standalone", "peers": [], "coordinator": None, "term": 0}
        st = self.elector.status()
        st["links"] = self.links
        sv = self.services
        st["services"] = None if sv is None else {**sv.status(), "weights": sv.weights, "draft": sv.draft}
        if self.no_services:
            st["no_services"] = self.no_services
        st["model"] = self.effective_model().to_json()
        st["cluster_settings"] = self.cluster_settings.status()
        st["assignments_refused"] = self.fence.refused  # not from the coordinator of their term
        st["revocation"] = self.gossip.status() if self.gossip is not None else None
        return st


def _read_config(model: str, held: held_exports.HeldExports) -> None:
    """Read a model's config once, from the store or from an export of it held here, and load the
    tokenizer's code (in a worker thread: see ``_coordinate``); failures are the coordinator
    services' to report."""
    from agent.models.store import LocalModel, ModelStore

    with contextlib.suppress(Exception):
        from transformers import AutoConfig, AutoTokenizer  # noqa: F401  (the coordinator loads both)

        m = ModelStore().get(model)
        if m is None:
            found = [h.dir for h in held.scan().values() if h.rel.startswith(f"{model}-")]
            m = LocalModel.from_export(found[0]) if found else None
        if m is not None:
            m.config()


def _differs(a: Advert, b: Advert) -> bool:
    if (a.state, a.reason, a.devices, round(a.score, 1)) != (b.state, b.reason, b.devices, round(b.score, 1)):
        return True
    return abs(a.mem_free - b.mem_free) > max(256 * MIB, a.mem_free // 10)


async def _started(d: AgentDaemon) -> AgentDaemon:
    try:
        await d.async_start()
    except BaseException:
        await d.async_shutdown()  # what did start (sockets, the HTTP session) is closed again
        raise
    return d


@contextlib.asynccontextmanager
async def running(settings: Settings, opts: DaemonOptions) -> AsyncIterator[AgentDaemon]:
    """A daemon inside the current event loop (for tests on real loopback sockets)."""
    d = await _started(AgentDaemon(settings, opts))
    try:
        yield d
    finally:
        await d.async_shutdown()
