"""An outgoing websocket link with an optional one-way delay and bandwidth (the WAN stand-in).

Frames are queued with their due time and sent in order by one task: a frame is due when an
emulated line of ``mbps`` has finished serialising it (and everything queued before it),
plus the one-way ``delay``. A delayed frame never holds back the frames queued after it
beyond their own due time: every frame sees the same latency, whichever stream it belongs to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable

import aiohttp

from agent.protocol import MAX_FRAME
from agent.security.errors import SecurityError
from agent.security.transport import Transport
from agent.serving import frametrace

log = logging.getLogger(__name__)


def _heartbeat_s() -> float:
    """Seconds of silence before a websocket is pinged (a missing pong then closes it after half
    as long again); ``LAKESHARD_HEARTBEAT_S`` shortens it for tests."""
    v = os.environ.get("LAKESHARD_HEARTBEAT_S", "")
    try:
        s = float(v) if v else 5.0
    except ValueError:
        s = -1.0
    if not 0.05 <= s <= 600:
        raise SystemExit(f"lakeshard: error: LAKESHARD_HEARTBEAT_S must be seconds from 0.05 to 600, not {v!r}")
    return s


HEARTBEAT_S = _heartbeat_s()


class LinkClosed(ConnectionError):
    pass


class Link:
    def __init__(
        self,
        url: str,
        *,
        transport: Transport,
        delay_ms: float = 0.0,
        mbps: float = 0.0,
        on_frame: Callable[[bytes], Awaitable[None]] | None = None,
        connect_timeout: float = 10.0,
        role: str | None = None,
    ) -> None:
        """``transport``: how it reaches the node at ``url`` (TLS: whose certificate it checks);
        ``role``: what this link is to the receiving agent (``"loop"``: a last stage's link back
        to stage 0, see :mod:`agent.serving.owners`)."""
        self.url = url
        self.transport = transport
        self._headers = {"X-Lakeshard-Link": role} if role else {}
        self.delay_s = max(0.0, delay_ms) / 1000.0
        self.bytes_per_s = mbps * 1e6 / 8 if mbps > 0 else 0.0
        self._tx_free_at = 0.0  # when the emulated line finishes sending what is queued
        self._on_frame = on_frame
        self._queue: asyncio.Queue[tuple[float, bytes, threading.Event | None]] = asyncio.Queue()
        self._connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    async def async_connect(self) -> None:
        self._session = self.transport.session()
        deadline = time.monotonic() + self._connect_timeout
        while True:
            try:
                self._ws = await self._session.ws_connect(
                    self.url, heartbeat=HEARTBEAT_S, max_msg_size=MAX_FRAME, compress=0, headers=self._headers
                )
            except (aiohttp.ClientError, OSError) as e:
                if time.monotonic() > deadline:
                    await self._session.close()
                    raise LinkClosed(f"cannot connect to {self.url}: {e}") from e
                await asyncio.sleep(0.1)
                continue
            try:
                self.transport.check_server(self._ws)
                break
            except SecurityError as e:
                await self._ws.close()
                await self._session.close()
                raise LinkClosed(f"refusing the node at {self.url}: {e}") from e
        self._tasks = [asyncio.create_task(self._sender()), asyncio.create_task(self._receiver())]

    async def async_send(self, frame: bytes) -> None:
        self.send_nowait(frame)

    def send_nowait(self, frame: bytes, sent: threading.Event | None = None) -> None:
        """Queue a frame (never blocks: callers bound their own in-flight work). ``sent`` is set
        once the frame is on the socket (on an emulated line: once it is queued on the line)."""
        if self._closed:
            raise LinkClosed(f"link to {self.url} is closed")
        now = time.monotonic()
        if self.bytes_per_s:
            self._tx_free_at = max(now, self._tx_free_at) + len(frame) / self.bytes_per_s
            due = self._tx_free_at + self.delay_s
        else:
            due = now + self.delay_s
        if sent is not None and (self.bytes_per_s or self.delay_s):
            sent.set()
            sent = None
        self._queue.put_nowait((due, frame, sent))

    async def _sender(self) -> None:
        assert self._ws is not None
        try:
            while True:
                due, frame, sent = await self._queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                try:
                    await self._ws.send_bytes(frame)
                finally:
                    if sent is not None:
                        sent.set()
                frametrace.mark("sent", "-", len(frame))
        except (ConnectionError, aiohttp.ClientError) as e:
            log.warning("link to %s failed: %s", self.url, e)
            self._closed = True

    async def _receiver(self) -> None:
        assert self._ws is not None
        async for msg in self._ws:
            if msg.type == aiohttp.WSMsgType.BINARY and self._on_frame is not None:
                try:
                    await self._on_frame(msg.data)
                except Exception:
                    log.exception("handling a frame from %s failed", self.url)
            elif msg.type == aiohttp.WSMsgType.ERROR:
                break
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed or self._ws is None or self._ws.closed

    async def async_close(self) -> None:
        self._closed = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
