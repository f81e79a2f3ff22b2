"""Term fencing tied to identity: who may command an elected agent over its control websocket.

On a secure link the peer's node id comes from its certificate (:func:`agent.security.transport.
peer_middleware` puts it in ``request["peer"]``). An elected agent with credentials admits an
:class:`~agent.protocol.Assign` only when that node is the coordinator it admitted for the
assignment's election term (the term's upper bits: :func:`agent.cluster.election.data_term`):

* ``stale_term``: the assignment's election term is below this node's (a replayed or late
  command of an older coordinator);
* ``unknown_term``: a term above this node's that its election has not admitted within
  ``WAIT_S`` (a coordinator's first beats arrive well before its first assignment);
* ``not_coordinator``: another node coordinates that term here, or the link shows no certificate.

The check runs before anything else of the assignment, so a refused one leaves the node's
stage, streams and terms as they were. Plaintext agents (no credentials, ``--insecure``) have no
identities to check and keep the term check alone; a standalone agent (driven by ``lakeshard
serve``, no election) admits any member of its cluster, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from agent.cluster.election import EPOCH_BITS, TermState
from agent.protocol import ProtocolError

WAIT_S = 3.0  # how long an assignment of a newer term waits for this node's election to admit it


class CoordinatorFence:
    """Admits commands only from the coordinator elected for their term (``state``: the persisted
    election state, e.g. ``TermStore.state``, read anew each time)."""

    def __init__(self, state: Callable[[], TermState], wait_s: float = WAIT_S) -> None:
        self.state, self.wait_s = state, wait_s
        self.refused = 0

    async def async_check(self, data_term: int, peer: str | None) -> None:
        """Return when ``peer`` coordinates the election term of ``data_term``, else raise
        :class:`ProtocolError` (``stale_term``, ``unknown_term`` or ``not_coordinator``)."""
        try:
            await self._async_check(data_term >> EPOCH_BITS, peer)
        except ProtocolError:
            self.refused += 1
            raise

    async def _async_check(self, term: int, peer: str | None) -> None:
        ts = self.state()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while (ts.term < term or (ts.term == term and ts.leader is None)) and loop.time() < deadline:
            await asyncio.sleep(0.05)
            ts = self.state()
        if term < ts.term:
            raise ProtocolError("stale_term", f"a command of term {term} refused: this node is in term {ts.term}")
        if term > ts.term:
            raise ProtocolError("unknown_term", f"no coordinator of term {term} is known here (term {ts.term})")
        if peer is None:
            raise ProtocolError("not_coordinator", "the link shows no node certificate")
        if ts.leader != peer:
            who = f"node {ts.leader} coordinates it" if ts.leader else "no coordinator is admitted in it"
            raise ProtocolError("not_coordinator", f"node {peer} is not the coordinator of term {term}: {who}")
