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

A list that fails the check is refused and the node carries on with the one it holds; fetching,
backing off after a failure and rate-limited warnings are :mod:`agent.cluster.gossip`'s, shared with the
cluster settings (:mod:`agent.cluster.settings_gossip`). The list on disk is also re-read every
:data:`REFRESH_S` (``cluster revoke`` on this node, from another process), so a CA holder's beats
say so at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from agent.cluster.gossip import DocumentGossip
from agent.protocol import Beat
from agent.security.errors import SecurityError
from agent.security.revocation import MAX_BYTES
from agent.security.transport import Transport

log = logging.getLogger(__name__)
REFRESH_S = 2.0
PATH = "/v1/cluster/revoked"


class RevocationGossip(DocumentGossip):
    """Fetches and adopts the newer revocation lists peers' beats announce (secure transports only)."""

    WHAT = "the revocation list"
    PATH = PATH
    MAX_BYTES = MAX_BYTES

    def __init__(self, transport: Transport) -> None:
        if transport.creds is None:
            raise ValueError("revocation gossip needs cluster credentials")
        super().__init__(transport, log)
        self.creds = transport.creds
        self._version = self.creds.revocation_version  # what connections were last checked against

    # -- beats -------------------------------------------------------------------------------------
    def on_beat(self, beat: Beat, src: tuple[str, int]) -> None:
        """A beat taken by the elector (signed, checked, its sender not revoked): fetch its
        sender's list if it announces a newer one and no fetch runs or waits out a failure."""
        if beat.revocation > self.creds.revocation_version:
            self.want(src, beat.port, beat.node, beat.revocation)

    async def take(self, data: bytes, node: str, offered: Any = None) -> bool:
        """Adopt the list in ``data`` (from node ``node``) if it is this cluster's, signed by its CA
        and newer than the one held; checked and written off the event loop."""
        try:
            taken = await asyncio.to_thread(self.creds.adopt, data)
        except (SecurityError, OSError) as e:
            self.refused += 1
            what = f"v{offered} " if offered is not None else ""
            self.failed_because(f"refused the revocation list {what}from node {node}: {e}")
            return False
        if not taken and offered is not None and offered > self.creds.revocation_version:
            self.refused += 1  # it announced a version it does not serve: not again at once
            self.failed_because(f"node {node} announced revocation list v{offered} but served an older one")
            return False
        self.succeeded()
        if taken:
            self.adopted += 1
            rl = self.creds.revoked
            names = ", ".join(sorted(rl.nodes)) if rl is not None and rl.nodes else "nobody"
            log.info("revocation list v%d from node %s: revoked %s", self.creds.revocation_version, node, names)
            self.check_connections()
        return taken

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
            await self.async_stop()

    def status(self) -> dict[str, Any]:
        return {"version": self.creds.revocation_version, **self.counters()}
