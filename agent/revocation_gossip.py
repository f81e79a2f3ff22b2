"""Revocation gossip: every member comes to hold the newest revocation list, whoever revoked.

``lakeshard cluster revoke NODE`` writes a new list (signed by the CA key) on the CA holder only.
Every member's signed beat carries the version of the list it holds (``Beat.revocation``); when
a member hears a beat (signed, from a node it does not refuse) that offers a higher version than
its own, it fetches that peer's list (``GET /v1/cluster/revoked`` on the peer's data port, over
mutual TLS, at most :data:`MAX_BYTES`), checks it off the event loop (the CA's signature, this
cluster, a newer version: :meth:`~agent.security.credentials.Credentials.adopt`) and adopts it:
``revoked.json`` is written atomically, and the credentials this node's TLS port and election
datagrams share refuse the revoked nodes at once; their connections still open are closed
(:meth:`~agent.security.transport.Transport.drop_revoked`).

A list that fails the check is refused (a WARNING at most every :data:`WARN_EVERY_S`) and the
node carries on with the one it holds: a forged version number costs a fetch, never the list.
One fetch at a time; after a failure, none for a while (:data:`BACKOFF_S`, doubling to
:data:`BACKOFF_MAX_S`). The list on disk is also re-read every :data:`REFRESH_S`
(``cluster revoke`` on this node, from another process), so a CA holder's beats say so at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp

from agent.protocol import Beat
from agent.security.errors import SecurityError
from agent.security.revocation import MAX_BYTES
from agent.security.transport import Transport

log = logging.getLogger(__name__)
FETCH_TIMEOUT_S = 5.0
BACKOFF_S = 1.0
BACKOFF_MAX_S = 60.0
WARN_EVERY_S = 30.0
REFRESH_S = 2.0
PATH = "/v1/cluster/revoked"


class RevocationGossip:
    """Fetches and adopts the newer revocation lists peers' beats announce (secure transports only)."""

    def __init__(self, transport: Transport) -> None:
        if transport.creds is None:
            raise ValueError("revocation gossip needs cluster credentials")
        self.transport = transport
        self.creds = transport.creds
        self.adopted = 0
        self.refused = 0
        self.failed = 0
        self.last_error: str | None = None
        self._task: asyncio.Task[bool] | None = None
        self._retry_at = float("-inf")  # monotonic: no fetch before this (backoff)
        self._backoff = BACKOFF_S
        self._warned = float("-inf")
        self._version = self.creds.revocation_version  # what connections were last checked against

    # -- beats -------------------------------------------------------------------------------------
    def on_beat(self, beat: Beat, src: tuple[str, int]) -> None:
        """A beat taken by the elector (signed, checked, its sender not revoked): fetch its
        sender's list if it announces a newer one and no fetch runs or waits out a failure."""
        if beat.revocation <= self.creds.revocation_version:
            return
        if self._task is not None and not self._task.done():
            return
        if time.monotonic() < self._retry_at:
            return
        host = f"[{src[0]}]" if ":" in src[0] else src[0]
        self._task = asyncio.get_running_loop().create_task(
            self.fetch(f"{host}:{beat.port}", beat.node, beat.revocation)
        )

    async def fetch(self, address: str, node: str, offered: int) -> bool:
        """Fetch node ``node``'s list from ``address`` (host:port) and adopt it if it is newer and
        valid; whether it was adopted. Failures are logged and back off further fetches."""
        try:
            data = await self._get(address)
        except (aiohttp.ClientError, OSError, TimeoutError, SecurityError) as e:
            self.failed += 1
            self._failed(f"cannot fetch the revocation list v{offered} from node {node} at {address}: {e}")
            return False
        return await self.take(data, node, offered)

    async def take(self, data: bytes, node: str, offered: int | None = None) -> bool:
        """Adopt the list in ``data`` (from node ``node``) if it is this cluster's, signed by its CA
        and newer than the one held; checked and written off the event loop."""
        try:
            taken = await asyncio.to_thread(self.creds.adopt, data)
        except (SecurityError, OSError) as e:
            self.refused += 1
            what = f"v{offered} " if offered is not None else ""
            self._failed(f"refused the revocation list {what}from node {node}: {e}")
            return False
        if not taken and offered is not None and offered > self.creds.revocation_version:
            self.refused += 1  # it announced a version it does not serve: not again at once
            self._failed(f"node {node} announced revocation list v{offered} but served an older one")
            return False
        self._retry_at, self._backoff, self.last_error = float("-inf"), BACKOFF_S, None
        if taken:
            self.adopted += 1
            rl = self.creds.revoked
            names = ", ".join(sorted(rl.nodes)) if rl is not None and rl.nodes else "nobody"
            log.info("revocation list v%d from node %s: revoked %s", self.creds.revocation_version, node, names)
            self.check_connections()
        return taken

    async def _get(self, address: str) -> bytes:
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
        async with (
            self.transport.session(timeout=timeout) as s,
            s.get(self.transport.url(address, PATH)) as r,
        ):
            if r.status != 200:
                raise SecurityError(f"HTTP {r.status}: {(await r.content.read(300)).decode(errors='replace')}")
            if r.content_length is not None and r.content_length > MAX_BYTES:
                raise SecurityError(f"the list is {r.content_length} bytes (at most {MAX_BYTES})")
            data = await r.content.read(MAX_BYTES + 1)
            if len(data) > MAX_BYTES:
                raise SecurityError(f"the list is more than {MAX_BYTES} bytes")
            return bytes(data)

    def _failed(self, why: str) -> None:
        self.last_error = why
        now = time.monotonic()
        self._retry_at = now + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            log.warning("%s (next try in %.0f s at the earliest)", why, self._retry_at - now)
        else:
            log.debug("%s", why)

    # -- the list on disk, and connections -----------------------------------------------------------
    def check_connections(self) -> None:
        """Close the open connections of nodes revoked since this was last called."""
        if self.creds.revocation_version != self._version:
            self._version = self.creds.revocation_version
            self.transport.drop_revoked()

    async def run(self) -> None:
        """Re-read the list on disk now and then (another process may have revoked a node)."""
        try:
            while True:
                await asyncio.sleep(REFRESH_S)
                try:
                    if await asyncio.to_thread(self.creds.refresh):
                        log.info("revocation list: version %d", self.creds.revocation_version)
                except SecurityError as e:
                    log.warning("cannot re-read the revocation list: %s", e)
                self.check_connections()
        finally:
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._task

    def status(self) -> dict[str, Any]:
        return {
            "version": self.creds.revocation_version,
            "adopted": self.adopted,
            "refused": self.refused,
            "fetch_failures": self.failed,
            "last_error": self.last_error,
        }
