"""The coordinator's data listener: the port the agents reach it on.

Two routes, for node traffic only (TLS with peer certificates when the cluster is secure):
``/ring``, the websocket the last stage returns its frames on, and
``/artifacts/{export}/{stage}/{name}``, a stage's export files for the agent assigned it. The
artifact route looks the export id up in a table, takes the stage as an integer index and the
name from a fixed list: no path from the request reaches the file system.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from agent.common.http import json_errors
from agent.protocol import MAX_FRAME
from agent.security.transport import TRANSPORT_KEY, Transport, peer_middleware
from agent.serving.link import HEARTBEAT_S
from agent.serving.stage_host import OPTIONAL_FILES, STAGE_FILES

log = logging.getLogger(__name__)
STOP_GRACE_S = 0.3  # on SIGTERM: for streams in flight to get their last chunk out

# what an agent may fetch of a stage's export: its manifest and the files it lists
SERVED_FILES = frozenset({"manifest.json", *STAGE_FILES, *OPTIONAL_FILES})


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def async_serve_site(
    app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> web.AppRunner:
    """Serve ``app`` on ``host:port``; the runner to clean up when done."""
    # on shutdown, handlers get STOP_GRACE_S to send their streams' last (error) chunk
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=STOP_GRACE_S)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    return runner


class DataListener:
    """The ring's return and the stage files, on one port the agents can reach.

    ``on_frame``: what to do with a frame the ring returns. ``stage_dirs``: an export id's
    stage folders (None: no such export is served). ``transport``: what the port serves (TLS
    with peer certificates, or plaintext) and the scheme of its URLs.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        port_fallback: bool,
        advertise_host: str | None,
        on_frame: Callable[[bytes], Awaitable[None]],
        stage_dirs: Callable[[str], list[Path] | None],
        transport: Transport,
    ) -> None:
        self.bind_host, self.wanted_port, self.port_fallback = host, port, port_fallback
        self.transport = transport
        self.advertise_host = advertise_host
        self.on_frame, self.stage_dirs = on_frame, stage_dirs
        self.host = ""  # where the agents reach it (once started)
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._rings: set[web.WebSocketResponse] = set()  # the ring's return links open now

    def _choose_port(self) -> int:
        want = self.wanted_port
        if not want:
            return free_port(self.bind_host)
        if self.port_fallback and not port_free(self.bind_host, want):
            port = free_port(self.bind_host)
            log.warning(
                "the coordinator's ring port %d is taken: using %d, which a firewall that opens only the "
                "configured ports will block (set serve.ring_port)",
                want,
                port,
            )
            return port
        return want

    async def async_start(self) -> None:
        self.port = self._choose_port()
        bind = self.bind_host
        self.host = self.advertise_host or (bind if bind not in ("0.0.0.0", "::") else socket.gethostname())
        # node traffic (the ring's return, stage files): TLS with peer certificates when secure
        app = web.Application(client_max_size=MAX_FRAME, middlewares=[json_errors, peer_middleware])
        app[TRANSPORT_KEY] = self.transport
        app.router.add_get("/ring", self._ring)
        app.router.add_get(r"/artifacts/{export}/{stage:\d+}/{name}", self._artifact)
        self._runner = await async_serve_site(app, bind, self.port, self.transport.server_ssl)

    async def _ring(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=MAX_FRAME, compress=False)
        await ws.prepare(request)
        self._rings.add(ws)
        try:
            async for m in ws:
                if m.type == aiohttp.WSMsgType.BINARY:
                    await self.on_frame(m.data)
        finally:
            self._rings.discard(ws)
        return ws

    async def _artifact(self, request: web.Request) -> web.StreamResponse:
        dirs = self.stage_dirs(request.match_info["export"])
        if dirs is None:
            raise web.HTTPNotFound()
        i, name = int(request.match_info["stage"]), request.match_info["name"]
        if not (0 <= i < len(dirs)) or name not in SERVED_FILES:
            raise web.HTTPNotFound()
        return web.FileResponse(dirs[i] / name)

    @property
    def return_url(self) -> str:
        """Where the last stage sends its frames back."""
        return self.transport.url(f"{self.host}:{self.port}", "/ring", ws=True)

    @property
    def artifacts_url(self) -> str:
        """Where the agents fetch their stages' files."""
        return self.transport.url(f"{self.host}:{self.port}", "/artifacts")

    async def async_stop(self) -> None:
        """Close the ring's return links, then the listener. Closed first, they end at once; left
        to the runner's cleanup, they held every stop of ``lakeshard serve`` past its time."""
        if self._rings:
            closing = asyncio.gather(*(ws.close() for ws in list(self._rings)), return_exceptions=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closing, STOP_GRACE_S)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
