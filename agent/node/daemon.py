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
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import psutil
from aiohttp import web

from agent import __version__
from agent.api.cluster_model import add_settings_route
from agent.api.gateway import Target, add_member_routes
from agent.api.local import make_local_app, serve_local
from agent.cluster.discovery import Advert, Discovery
from agent.cluster.election import Timing, data_term
from agent.cluster.elector import Elector
from agent.cluster.fencing import CoordinatorFence
from agent.cluster.node_state import TermStore, node_id
from agent.cluster.offers import Member
from agent.cluster.peers import LocalNode
from agent.cluster.revocation_gossip import RevocationGossip
from agent.cluster.settings_gossip import Effective, SettingsGossip, effective
from agent.common.config import Settings
from agent.common.paths import agent_state_dir
from agent.common.ports import ListenError
from agent.export import held as held_exports
from agent.node import offering, status, views
from agent.node.replication import ExportCopies
from agent.node.roles import Services
from agent.node.shutdown import bounded
from agent.node.supervise import Supervisor
from agent.node.views import heard_peers
from agent.protocol.cluster_view import NodeInfo
from agent.security import transport
from agent.security.datagrams import for_credentials
from agent.security.routes import add_cluster_routes, membership
from agent.security.transport import peer_middleware
from agent.serving.endpoint import make_app
from agent.serving.stage_host import StageHost
from agent.throttle.controller import Contribution

log = logging.getLogger(__name__)
# settings a running agent takes at once, and those it takes at its next start
LIVE_KEYS = ("preferred", "exclude", "min_coordinator_memory", "log_level", "name", "throttle")
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
    "serve_attention",
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
    attention: str = "auto"  # how its stage attends: "auto", "paged" or "stateful" (config.attention_setting)
    standalone: bool = False
    throttle: bool = True  # follow the throttle policy (settings: throttle.enabled); off for local clusters
    insecure: bool = False  # plaintext node links (never without it: no credentials is an error)
    timing: Timing = field(default_factory=Timing)


def _warn_other_node(node: str, named: str) -> None:
    log.warning(
        "this agent is node %s but its certificate names node %s (made for another port?): members "
        "refuse its election datagrams and will not accept it as their coordinator; join again with a new "
        "token ('cluster join --force')",
        node,
        named,
    )


def _local_node(node: str, settings: Settings) -> LocalNode:
    """What this laptop says of itself in its beats and adverts."""
    return LocalNode(
        node=node,
        cluster=settings.cluster_id,
        port=settings.port,
        version=__version__,
        mem_total=psutil.virtual_memory().total,
        mem_free=lambda: int(psutil.virtual_memory().available),
        name=settings.name or socket.gethostname()[:64] or None,
    )


class AgentDaemon:
    def __init__(self, settings: Settings, opts: DaemonOptions, config_path: Any = None) -> None:
        self.settings, self.opts = settings, opts
        self.config_path = config_path  # the settings file it was started with (None: the default)
        # node links: mutual TLS when this node has cluster credentials (chosen once, here, and
        # handed to every part that links to other nodes)
        self.transport = transport.choose(opts.insecure, why=INSECURE_WHY)
        creds = self.transport.creds
        settings = self.settings = _own_cluster(settings, creds.cluster_id if creds is not None else None)
        folder = agent_state_dir(settings.port)  # several agents on one machine: one each
        self.node = node_id(folder)
        if creds is not None and creds.node_id != self.node:
            _warn_other_node(self.node, creds.node_id)
        # standalone agents take their term from a 'serve' coordinator, not from an election
        self.store = TermStore(folder, persist=not opts.standalone)
        self.fence = CoordinatorFence(lambda: self.store.state)
        self.host = StageHost(
            transport=self.transport,
            device=opts.device,
            threads=opts.threads,
            spin_ms=opts.spin_ms,
            head_help=opts.head_help,
            attention=opts.attention,
        )
        self.host.term_seen = data_term(self.store.state.term)
        self.held = held_exports.HeldExports()  # whole exports on this disk (a stage assigned from one: no download)
        self.host.held = self.held
        self.me = _local_node(self.node, settings)
        self.copies = ExportCopies(
            self.held, self.me, self.host, lambda: heard_peers(self), self._needed_exports, transport=self.transport
        )
        self.elector: Elector | None = None
        self.discovery: Discovery | None = None
        self.gossip: RevocationGossip | None = None
        self.supervisor = Supervisor(self)  # the coordinator's services, while this node is elected
        # the model the cluster serves: a signed, versioned document every member holds (gossiped)
        self.cluster_settings = SettingsGossip(self.transport, settings.cluster_id, self.node, on_change=self._held)
        self.cluster_settings.load()
        self.capacity: dict[str, Any] | None = None
        self.api_port = settings.api_port
        self.serves_local_api = True
        self.started = time.time()
        self.stopping = False  # shutting down (the gateway then lets answers end as they end)
        self._advertised: Advert | None = None
        self._runners: list[web.AppRunner] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.services: Services | None = None  # while this node coordinates (see agent.node.supervise)
        self.no_services: str | None = None  # why this agent cannot coordinate (no coordinator installed)
        self.session: aiohttp.ClientSession | None = None  # forwarding to the coordinator
        # the user's switch and the throttle policy: this node's state, applied to its stage
        self.contrib = Contribution(
            self.me,
            self.host.throttle,
            lambda: self.settings.throttle,
            enabled=opts.throttle and settings.throttle.enabled,
        )
        self._throttle_task: asyncio.Task[None] | None = None  # reading the probes (while the throttle is on)
        self.tokens_seen = (time.monotonic(), 0)  # (when, positions): the token rate

    # -- lifecycle -----------------------------------------------------------------------------
    async def async_start(self) -> None:
        self.session = self.transport.session()
        await self._serve_public()
        if self.serves_local_api:  # else agent.node.unjoined.LocalAgent serves it (and set api_port)
            self.api_port = await serve_local(self._runners, make_local_app(self), self.settings.api_port)
        if not self.opts.standalone:
            await self._join_election()
        self._spawn(offering.probe(self))
        self._spawn(offering.refresh(self))
        if self.contrib.enabled:
            self._throttle_task = self._spawn(self.contrib.run())
        if self.elector is not None:
            self._spawn(self.supervisor.run())
            self._spawn(self.copies.run())

    def _spawn(self, job: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        t = asyncio.create_task(job)
        self._tasks.append(t)
        return t

    async def _serve_public(self) -> None:
        """The data port (TCP): the stage server, the cluster identity routes and, for members, the
        coordinator forwarded, the exports held here and the cluster settings."""
        # elected agents with credentials take assignments only from the coordinator of their term
        fence = self.fence.async_check if self.transport.secure and not self.opts.standalone else None
        public = make_app(self.host, self.transport, self.node_status, [peer_middleware], fence)
        add_cluster_routes(public)  # cluster identity: the CA, joining, the revocation list
        log.info("%s", membership(self.node))
        if not self.opts.standalone:
            add_member_routes(public, self)
            held_exports.add_routes(public, self.held, self._may_fetch)
            add_settings_route(public, self.cluster_settings)  # what peers fetch (members only)
        try:
            self.me.port = await self._serve(public, self.opts.host, self.settings.port, self.transport.server_ssl)
        except OSError as e:
            raise ListenError(
                f"the data port {self.opts.host}:{self.settings.port} is taken ({e.strerror or e}); another agent may "
                "be running: give this one another --port (or 'port' in the settings)"
            ) from None

    async def _join_election(self) -> None:
        """Peer messages on the same port number (UDP), the gossip that rides on beats, and mDNS."""
        signed = for_credentials(self.transport.creds)  # election datagrams: signed with credentials
        self.elector = Elector(self.me, self.settings, self.store, self.opts.timing, signed)
        self.elector.on_term = self._on_term
        self.elector.on_change = self.supervisor.changed  # the services follow the role and the term
        if self.transport.secure:  # members adopt the newest revocation list their peers' beats announce
            self.gossip = RevocationGossip(self.transport)
            self._spawn(self.gossip.run())
        self.elector.on_beat_heard = self._on_beat  # and the newest cluster settings
        self._spawn(self.cluster_settings.run())
        await self.elector.async_start(self.opts.host)
        if self.settings.mdns:
            self.discovery = Discovery(
                self.settings.cluster_id, self.advert, self._on_advert, self.elector.on_goodbye, self.settings.interface
            )
            await self.discovery.async_start()
            self._advertised = self.advert()

    async def _serve(
        self, app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None
    ) -> int:
        """Serve ``app``; returns the port it got (``port`` 0: any free one)."""
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self._runners.append(runner)
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
        return int(runner.addresses[-1][1])

    async def async_stop(self) -> None:
        """Stop in the order the other nodes notice, every step bounded (see :mod:`agent.node.shutdown`).

        The election first: a coordinator's last beat says it stepped down, and with the beats
        stopped the peers count this node gone within ``peer_timeout_s``. Then, side by side, the
        coordinator's services (streams in flight end with an error chunk) and the mDNS goodbye;
        then the listeners (a peer that never answers a websocket close cannot hold the exit up)."""
        self.stopping = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:  # (each ends at its next await: a thread it waits on is left to finish alone)
            await bounded(asyncio.gather(*self._tasks, return_exceptions=True), 0.1, "the daemon's tasks")
        if self.elector is not None:
            await bounded(self.elector.async_stop(), 0.1, "the election's last beat")
        steps = []
        if self.services is not None:
            steps.append(bounded(self.services.async_stop(), SERVICES_STOP_S, "the coordinator's services"))
        if self.discovery is not None:
            steps.append(bounded(self.discovery.async_close(), SERVICES_STOP_S, "the mDNS goodbye"))
        await asyncio.gather(*steps)
        await asyncio.gather(*(bounded(r.cleanup(), LISTENERS_STOP_S, "a listener") for r in self._runners))
        if self.session is not None:
            await bounded(self.session.close(), 0.1, "the HTTP session")

    def set_state(self, state: str, for_s: float | None = None) -> None:
        """The user's switch: pause, limit or resume contributing (``for_s``: it resets after that)."""
        self.contrib.set_manual(state, for_s)

    def apply_settings(self, new: Settings, before: Settings | None = None) -> list[str]:
        """Take new settings from the settings file (``before``: what it said until now).

        The election's, the name, the log level and the throttle's apply at once; the rest take
        effect at the next start, and the names of those that changed are returned."""
        was = before or self.settings
        restart = [k for k in RESTART_KEYS if getattr(was, k) != getattr(new, k)]
        live = {k: getattr(new, k) for k in LIVE_KEYS}
        throttle_was = self.settings.throttle
        self.settings = replace(self.settings, **live)
        if new.name != was.name:
            self.me.name = new.name or socket.gethostname()[:64] or None
        if self.elector is not None:
            self.elector.settings = self.settings
        if self.settings.throttle != throttle_was:
            self._throttle_changed()
        return restart

    def _throttle_changed(self) -> None:
        """The throttle's settings changed: follow them at once (starting the probes if it was off)."""
        on = self.opts.throttle and self.settings.throttle.enabled
        self.contrib.enabled = on
        if on and (self._throttle_task is None or self._throttle_task.done()) and _loop_running():
            self._throttle_task = self._spawn(self.contrib.run())
        self.contrib.reconsider()
        log.info("throttle settings applied: %s", self.settings.throttle)

    def running_settings(self) -> Settings:
        """The settings this agent runs with (its command line's, its certificate's cluster, the
        throttle as it runs), which may differ from its settings file."""
        return replace(self.settings, throttle=replace(self.settings.throttle, enabled=self.contrib.enabled))

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
        self.supervisor.changed()  # a newer model to serve: the services restart onto it

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

    @property
    def links(self) -> str:
        """How this node's links to other nodes travel: "TLS" (mutual, its cluster's certificates) or "PLAINTEXT"."""
        return "TLS" if self.transport.secure else "PLAINTEXT"

    # -- what it hears (agent.node.views) and its status answers (agent.node.status) ------------------
    def node_infos(self) -> list[NodeInfo]:
        """Every node this one hears right now (itself first), as node maps show them."""
        return views.node_infos(self)

    def _members(self) -> list[Member]:
        return views.members(self)

    def coordinator_target(self) -> Target | None:
        """Where the coordinator's services are (see :mod:`agent.api.gateway`); None during an election."""
        return views.coordinator_target(self)

    def is_member_address(self, ip: str) -> bool:
        """Whether ``ip`` is a live peer's (the public port serves the coordinator to members only)."""
        return views.is_member_address(self, ip)

    def node_status(self) -> dict[str, Any]:
        return status.node_status(self)

    def cluster_status(self) -> dict[str, Any]:
        return status.cluster_status(self)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _own_cluster(settings: Settings, certified: str | None) -> Settings:
    """The settings with the cluster of this node's certificate, when it has one (it wins)."""
    if certified is None or settings.cluster_id == certified:
        return settings
    if settings.cluster_id != "default":
        log.warning(
            "the settings' cluster_id %r is not this node's cluster: using %s (from its certificate)",
            settings.cluster_id,
            certified,
        )
    return replace(settings, cluster_id=certified)


async def _started(d: AgentDaemon) -> AgentDaemon:
    try:
        await d.async_start()
    except BaseException:
        await d.async_stop()  # what did start (sockets, the HTTP session) is closed again
        raise
    return d


@contextlib.asynccontextmanager
async def running(settings: Settings, opts: DaemonOptions) -> AsyncIterator[AgentDaemon]:
    """A daemon inside the current event loop (for tests on real loopback sockets)."""
    d = await _started(AgentDaemon(settings, opts))
    try:
        yield d
    finally:
        await d.async_stop()
