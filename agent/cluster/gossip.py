"""Gossip of a document every member should hold the newest of (the revocation list, the
cluster settings): beats announce the version a member holds; a member that hears of a newer
one fetches it from that peer's data port and adopts it once it checks out.

:class:`DocumentGossip` is the part both share: one fetch at a time (``GET`` :attr:`PATH` on the
peer's data port, mutual TLS in a secured cluster, at most :attr:`MAX_BYTES`), and after a
failure none for a while (:data:`BACKOFF_S`, doubling to :data:`BACKOFF_MAX_S`), with a WARNING
at most every :data:`WARN_EVERY_S`: a forged version number costs a fetch, never the document.
Subclasses say what a newer document is, and how it is checked (off the event loop) and adopted
(:meth:`DocumentGossip.take`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, ClassVar

import aiohttp

from agent.security.errors import SecurityError
from agent.security.transport import Transport

FETCH_TIMEOUT_S = 5.0
BACKOFF_S = 1.0
BACKOFF_MAX_S = 60.0
WARN_EVERY_S = 30.0


class DocumentGossip:
    """Fetches the newer documents peers' beats announce; counts what it adopts and refuses."""

    WHAT: ClassVar[str] = "document"  # what log lines call it
    PATH: ClassVar[str] = ""
    MAX_BYTES: ClassVar[int] = 1024 * 1024

    def __init__(self, transport: Transport, log: logging.Logger) -> None:
        self.transport = transport
        self.log = log
        self.adopted = 0
        self.refused = 0
        self.failed = 0
        self.last_error: str | None = None
        self._task: asyncio.Task[bool] | None = None
        self._retry_at = float("-inf")  # monotonic: no fetch before this (backoff)
        self._backoff = BACKOFF_S
        self._warned = float("-inf")

    # -- what subclasses say -------------------------------------------------------------------
    def describe(self, offered: Any) -> str:
        """How log lines name an announced version (``v3``)."""
        return f"v{offered}"

    async def take(self, data: bytes, node: str, offered: Any = None) -> bool:
        """Check the document in ``data`` (from node ``node``) and adopt it if it is newer."""
        raise NotImplementedError

    # -- fetching ------------------------------------------------------------------------------
    def want(self, src: tuple[str, int], port: int, node: str, offered: Any) -> None:
        """Fetch node ``node``'s document (at ``src``'s host, data ``port``) unless a fetch runs
        or waits out a failure."""
        if self._task is not None and not self._task.done():
            return
        if time.monotonic() < self._retry_at:
            return
        host = f"[{src[0]}]" if ":" in src[0] else src[0]
        self._task = asyncio.get_running_loop().create_task(self.fetch(f"{host}:{port}", node, offered))

    async def fetch(self, address: str, node: str, offered: Any) -> bool:
        """Fetch node ``node``'s document from ``address`` (host:port) and adopt it if it is newer
        and valid; whether it was adopted. Failures are logged and back off further fetches."""
        try:
            data = await self._get(address)
        except (aiohttp.ClientError, OSError, TimeoutError, SecurityError) as e:
            self.failed += 1
            self.failed_because(f"cannot fetch {self.WHAT} {self.describe(offered)} from node {node} at {address}: {e}")
            return False
        return await self.take(data, node, offered)

    async def _get(self, address: str) -> bytes:
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
        most = self.MAX_BYTES
        async with (
            self.transport.session(timeout=timeout) as s,
            s.get(self.transport.url(address, self.PATH)) as r,
        ):
            if r.status != 200:
                raise SecurityError(f"HTTP {r.status}: {(await r.content.read(300)).decode(errors='replace')}")
            if r.content_length is not None and r.content_length > most:
                raise SecurityError(f"it is {r.content_length} bytes (at most {most})")
            data = await r.content.read(most + 1)
            if len(data) > most:
                raise SecurityError(f"it is more than {most} bytes")
            return bytes(data)

    def succeeded(self) -> None:
        """A fetch (or a direct hand-over) went through: fetch at once when next told of one."""
        self._retry_at, self._backoff, self.last_error = float("-inf"), BACKOFF_S, None

    def failed_because(self, why: str) -> None:
        """Remember why, back off, and log it (a WARNING at most every WARN_EVERY_S)."""
        self.last_error = why
        now = time.monotonic()
        self._retry_at = now + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            self.log.warning("%s (next try in %.0f s at the earliest)", why, self._retry_at - now)
        else:
            self.log.debug("%s", why)

    async def async_stop(self) -> None:
        """Cancel the fetch in progress, if any."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def counters(self) -> dict[str, Any]:
        return {
            "adopted": self.adopted,
            "refused": self.refused,
            "fetch_failures": self.failed,
            "last_error": self.last_error,
        }
