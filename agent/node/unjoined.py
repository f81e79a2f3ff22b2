"""``lakeshard agent``: the local API at once, the daemon once this node is in a cluster.

An agent never speaks plaintext on the network unless told to (``--insecure``, or
``insecure: true`` in the settings; logged loudly). Without cluster credentials it *waits for a
cluster*: no data port, no mDNS, no election, only its local API on 127.0.0.1, where
``GET /v1/node`` says ``"state": "no_cluster"`` with a one-line hint, and the cluster routes
(:mod:`agent.security.local_routes`) make or join one. When credentials appear (through those routes, or
``lakeshard cluster init|join`` run in a terminal: the security folder is looked at every
second) the full agent (:class:`agent.node.daemon.AgentDaemon`) starts in the same process, and the
local API goes on answering on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from agent import __version__
from agent.api.gateway import Target
from agent.api.local import NotJoined, make_local_app, serve_local
from agent.cluster.node_state import node_id
from agent.cluster.settings_gossip import Effective, SettingsGossip, effective
from agent.common.config import Settings
from agent.common.paths import agent_state_dir, log_dir
from agent.node.daemon import LIVE_KEYS, RESTART_KEYS, AgentDaemon, DaemonOptions, _started
from agent.node.shutdown import HARD_EXIT_S, SHUTDOWN_S, bounded, exit_after, exit_now
from agent.protocol.status import NO_CLUSTER, ClusterStatus, NodeStatus
from agent.security import files
from agent.security.errors import SecurityError
from agent.security.local_routes import Identity, add_cluster_api
from agent.security.transport import NO_CLUSTER_HINT, Transport

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often a waiting agent looks for credentials
LOCAL_API_STOP_S = 0.2  # on shutdown, after the daemon's steps (agent.node.shutdown.SHUTDOWN_S in all)


class LocalAgent:
    """This laptop's agent as its local API sees it: waiting for a cluster, then the daemon."""

    def __init__(
        self, settings: Settings, opts: DaemonOptions, config_path: Any = None, folder: Path | None = None
    ) -> None:
        self.settings, self.opts, self.config_path = settings, opts, config_path
        self.folder = folder  # the security folder (None: the default one)
        self.node = node_id(agent_state_dir(settings.port))  # what AgentDaemon will read back
        self.daemon: AgentDaemon | None = None
        self.api_port = settings.api_port
        self.started = time.time()
        self.error: str | None = None  # why the last start as a member failed
        self._failed_on: tuple[float, float] | None = None  # the credentials it failed with
        self._runners: list[web.AppRunner] = []
        self._watch: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    # -- lifecycle -----------------------------------------------------------------------------
    async def async_start(self) -> None:
        app = make_local_app(self)
        add_cluster_api(app, Identity(lambda: self.node, self._invite_address, self._credentials_came, self.folder))
        self.api_port = await serve_local(self._runners, app, self.settings.api_port)
        try:
            if self.opts.insecure or self._credentials() is not None:
                await self._start_daemon()  # at start, its errors stop the agent (as they always did)
        except BaseException:
            await self.async_stop()
            raise
        if self.daemon is None:
            log.warning(
                "%s (until then: no data port, no discovery, no election; only the status API on 127.0.0.1:%d)",
                NO_CLUSTER_HINT,
                self.api_port,
            )
            self._watch = asyncio.create_task(self._wait_for_credentials())

    async def async_stop(self) -> None:
        """The daemon's bounded shutdown, then the local API (last: it relays the coordinator's
        error chunks to the streams in flight through it), also bounded."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self.daemon is not None:
            await self.daemon.async_stop()
        for r in reversed(self._runners):
            await bounded(r.cleanup(), LOCAL_API_STOP_S, "the local API")

    def _credentials(self) -> tuple[float, float] | None:
        """When the node certificate and CA were written, if both are there (None: not a member)."""
        d = files.security_path(self.folder)
        try:
            return (d / files.NODE_CERT).stat().st_mtime, (d / files.CA_CERT).stat().st_mtime
        except OSError:
            return None

    async def _wait_for_credentials(self) -> None:
        while self.daemon is None:
            await asyncio.sleep(POLL_S)
            await self._credentials_came()

    async def _credentials_came(self) -> str | None:
        """Start as a member if there are credentials not yet tried; why it failed, if it did."""
        async with self._lock:
            seen = self._credentials()
            if self.daemon is not None and not self.daemon.transport.secure:
                return "this agent runs --insecure (plaintext): restart it without to use the cluster's credentials"
            if self.daemon is not None or seen is None or seen == self._failed_on:
                return self.error
            try:
                await self._start_daemon()
            except Exception as e:
                self.error, self._failed_on = str(e) or type(e).__name__, seen
                log.error("cannot start as a cluster member: %s", self.error)
            return self.error

    async def _start_daemon(self) -> None:
        d = AgentDaemon(self.settings, self.opts, self.config_path)
        d.serves_local_api, d.api_port = False, self.api_port
        self.daemon = await _started(d)
        self.error = None
        if self._watch is not None:
            log.info("cluster credentials found: starting as a member")
        mode = "standalone" if self.opts.standalone else f"cluster {d.settings.cluster_id}"
        links = d.links
        print(
            f"lakeshard agent {d.node} ({mode}) listening on {self.opts.host}:{d.me.port} ({links}), "
            f"status API on 127.0.0.1:{self.api_port}",
            flush=True,
        )

    def _invite_address(self) -> str:
        """This machine's LAN address and data port (what ``cluster invite`` puts in a token)."""
        from agent.cluster.discovery import local_addresses

        ips = local_addresses(self.settings.interface)
        if not ips:
            raise SecurityError("this machine has no LAN address to put in the token: give an address (host:port)")
        port = self.daemon.me.port if self.daemon is not None else self.settings.port
        return f"[{ips[0]}]:{port}" if ":" in ips[0] else f"{ips[0]}:{port}"

    # -- what the local API asks ---------------------------------------------------------------
    @property
    def session(self) -> aiohttp.ClientSession | None:
        return self.daemon.session if self.daemon is not None else None

    @property
    def transport(self) -> Transport | None:
        return self.daemon.transport if self.daemon is not None else None

    def coordinator_target(self) -> Target | None:
        return self.daemon.coordinator_target() if self.daemon is not None else None

    def is_member_address(self, ip: str) -> bool:
        return self.daemon is not None and self.daemon.is_member_address(ip)

    @property
    def stopping(self) -> bool:
        return self.daemon is not None and self.daemon.stopping

    def node_status(self) -> dict[str, Any]:
        d = self.daemon
        if d is not None:
            creds = d.transport.creds
            return {**d.node_status(), "holds_ca": bool(creds and creds.holds_ca)}
        return NodeStatus(
            node=self.node,
            name=self.settings.name or socket.gethostname()[:64] or None,
            version=__version__,
            state=NO_CLUSTER,
            role=NO_CLUSTER,
            hint=NO_CLUSTER_HINT,
            error=self.error,
            api_port=self.api_port,
            log_dir=str(log_dir()),
            config_file=str(self.config_path) if self.config_path else None,
            started=self.started,
        ).to_json()

    def cluster_status(self) -> dict[str, Any]:
        if self.daemon is not None:
            return self.daemon.cluster_status()
        return ClusterStatus(node=self.node, role=NO_CLUSTER, hint=NO_CLUSTER_HINT).to_json()

    def model_settings(self) -> SettingsGossip | None:
        return self.daemon.model_settings() if self.daemon is not None else None

    def effective_model(self) -> Effective:
        if self.daemon is not None:
            return self.daemon.effective_model()
        return effective(self.settings.serve_model, self.settings.serve_weights, None)

    def serve_override(self) -> tuple[str | None, str | None]:
        return self.settings.serve_model, self.settings.serve_weights

    def display_name(self) -> str:
        return self.daemon.display_name() if self.daemon is not None else self.settings.name or self.node

    def set_state(self, state: str, for_s: float | None = None) -> None:
        if self.daemon is None:
            raise NotJoined(NO_CLUSTER_HINT)
        self.daemon.set_state(state, for_s)

    def running_settings(self) -> Settings:
        return self.daemon.running_settings() if self.daemon is not None else self.settings

    def apply_settings(self, new: Settings, before: Settings | None = None) -> list[str]:
        if self.daemon is not None:
            return self.daemon.apply_settings(new, before)
        was = before or self.settings  # (kept for the daemon this agent starts once it joins)
        self.settings = replace(self.settings, **{k: getattr(new, k) for k in LIVE_KEYS})
        return [k for k in RESTART_KEYS if getattr(was, k) != getattr(new, k)]


async def _main(settings: Settings, opts: DaemonOptions, config_path: Any = None) -> None:
    a = LocalAgent(settings, opts, config_path)
    await a.async_start()
    if a.daemon is None:
        print(
            f"lakeshard agent {a.node} waiting for a cluster (no data port until then), "
            f"status API on 127.0.0.1:{a.api_port}",
            flush=True,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # Windows
            loop.add_signal_handler(sig, stop.set)
    code = 0
    try:
        await stop.wait()
    except asyncio.CancelledError:  # ^C where signal handlers cannot be set (Windows)
        code = 130
    # within SHUTDOWN_S of the signal: the graceful part, then exit without waiting for worker
    # threads, an export's child process or OpenVINO's teardown (see agent.node.shutdown)
    exit_after(HARD_EXIT_S, code)
    await bounded(a.async_stop(), SHUTDOWN_S, "the agent's shutdown")
    exit_now(code)


def run_agent(settings: Settings, opts: DaemonOptions, config_path: Any = None) -> None:
    """Run until SIGTERM or SIGINT, then exit within about 1.5 s (never returns after a signal)."""
    from agent.common.aio import run

    run(_main(settings, opts, config_path))
