"""How node-to-node traffic travels: mutual TLS with this cluster's certificates, or plaintext.

A :class:`Transport` is chosen once when a process starts (:func:`choose`) and handed to every
part that links to other nodes (a constructor's ``transport`` argument; an aiohttp app holds it
under :data:`TRANSPORT_KEY`). There is no process-wide one: two agents in one process (tests)
each keep their own.

* :meth:`Transport.url`: ``https``/``wss`` (secure) or ``http``/``ws`` (plaintext) for a node
  address ``host:port``;
* :meth:`Transport.session`: an aiohttp client session whose connector shows this node's
  certificate and trusts only the cluster CA;
* :meth:`Transport.server_ssl`: the SSL context for the public data port (None: plaintext);
* :meth:`Transport.check_server` / :meth:`Transport.node_at`: the node id in the certificate of
  the server a client reached (refusing revoked nodes); the gateway checks the coordinator's;
* :func:`peer_middleware`: on a secure port (the app's :data:`TRANSPORT_KEY`), the peer's node
  id is taken from its certificate (``request["peer"]``), revoked nodes are refused with 403, and
  only the public cluster routes (the CA, joining, the revocation list) answer a client that
  shows no certificate.
* :meth:`Transport.drop_revoked`: once the revocation list names a node, its connections that
  are still open (a websocket or a request in progress here, a link this node opened to it) are
  closed; every new request or handshake of it is refused anyway.

There is no silent plaintext: :func:`choose` gives it only when asked (``--insecure``, or
``insecure: true`` in the settings), and refuses a node without credentials otherwise.

The local status API and the OpenAI API on loopback stay plain HTTP (not node-to-node).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from agent.common.http import api_error
from agent.security.credentials import Credentials, NotMember
from agent.security.errors import SecurityError

log = logging.getLogger(__name__)

# what a client without a certificate may still ask a secure port (joining needs them)
PUBLIC_PATHS = frozenset({"/v1/cluster/ca", "/v1/cluster/join", "/v1/cluster/revoked"})
NODE_AT_S = 30.0  # how long the node id behind an address is remembered
REFRESH_S = 2.0  # how often the revocation list is re-read from disk (another process may revoke)
NO_CLUSTER_HINT = (
    "not in a cluster: run 'lakeshard cluster init' on the first laptop, or 'lakeshard cluster join TOKEN' "
    "with a token from 'lakeshard cluster invite'"
)
PLAINTEXT_WARNING = (
    "PLAINTEXT: links between nodes are NOT encrypted or authenticated ({why}); "
    "run 'lakeshard cluster init' (first node) or 'lakeshard cluster join TOKEN' to secure them"
)


@dataclass
class Transport:
    """Secure (``creds`` set) or plaintext transport for node-to-node links."""

    creds: Credentials | None = None
    _server: ssl.SSLContext | None = field(default=None, repr=False)
    _client: ssl.SSLContext | None = field(default=None, repr=False)
    _refreshed: float = field(default=0.0, repr=False)
    _nodes_at: dict[str, tuple[str, float]] = field(default_factory=dict, repr=False)
    # connections open now, by the node at their other end: requests it is making here (their
    # asyncio transport) and websockets this node opened to it
    _serving: dict[str, set[asyncio.Transport]] = field(default_factory=dict, repr=False)
    _links: dict[str, weakref.WeakSet[aiohttp.ClientWebSocketResponse]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.creds is not None:
            self._server = self.creds.server_ssl_context()
            # a joiner shows no certificate; it may still fetch the CA and join (see PUBLIC_PATHS).
            # A certificate that is shown must be this cluster's: the handshake fails otherwise.
            self._server.verify_mode = ssl.CERT_OPTIONAL
            self._client = self.creds.client_ssl_context()

    @property
    def secure(self) -> bool:
        return self.creds is not None

    @property
    def server_ssl(self) -> ssl.SSLContext | None:
        return self._server

    @property
    def client_ssl(self) -> ssl.SSLContext | None:
        return self._client

    def url(self, address: str, path: str = "", *, ws: bool = False) -> str:
        """The URL of ``path`` on the node at ``address`` (host:port)."""
        scheme = ("wss" if ws else "https") if self.secure else ("ws" if ws else "http")
        return f"{scheme}://{address}{path}"

    def session(self, **kw: Any) -> aiohttp.ClientSession:
        """A client session for node-to-node requests (``kw`` goes to ``ClientSession``)."""
        if self._client is None:
            return aiohttp.ClientSession(**kw)
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._client), **kw)

    def peer(self, ssl_object: Any) -> str | None:
        """The node id in the certificate the peer showed (``ssl_object`` of its connection), None
        when it showed none; :class:`SecurityError` when it is revoked or otherwise unusable."""
        if self.creds is None or ssl_object is None:
            return None
        if not ssl_object.getpeercert(binary_form=True):
            return None
        now = time.monotonic()
        if now - self._refreshed > REFRESH_S:
            self._refreshed = now
            try:
                if self.creds.refresh():
                    log.info("revocation list: version %d", self.creds.revocation_version)
                    self.drop_revoked()
            except SecurityError as e:
                log.warning("cannot re-read the revocation list: %s", e)
        return self.creds.peer_node_id(ssl_object)

    def check_server(self, ws: aiohttp.ClientWebSocketResponse) -> str | None:
        """The node id of the server a websocket reached; :class:`SecurityError` when it is
        revoked (the TLS handshake itself checks only the CA). The link is closed if that node
        is revoked later (:meth:`drop_revoked`)."""
        if self.creds is None:
            return None
        node = self.peer(ws.get_extra_info("ssl_object"))
        if node is not None:
            self._links.setdefault(node, weakref.WeakSet()).add(ws)
        return node

    def serving(self, node: str, conn: asyncio.Transport) -> None:
        """``node`` is making a request on ``conn`` (until :meth:`served`)."""
        self._serving.setdefault(node, set()).add(conn)

    def served(self, node: str, conn: asyncio.Transport) -> None:
        conns = self._serving.get(node)
        if conns is not None:
            conns.discard(conn)
            if not conns:
                del self._serving[node]

    def drop_revoked(self) -> int:
        """Close every open connection of a node the revocation list names; how many it closed."""
        if self.creds is None:
            return 0
        closed = 0
        for node in [n for n in (*self._serving, *self._links) if self.creds.is_revoked(n)]:
            for conn in self._serving.pop(node, set()):
                if not conn.is_closing():
                    conn.abort()
                    closed += 1
            for ws in list(self._links.pop(node, ())):
                if not ws.closed:
                    asyncio.get_running_loop().create_task(ws.close())
                    closed += 1
            log.info("node %s is revoked: closed its open connections", node)
        return closed

    async def node_at(self, address: str, timeout: float = 5.0) -> str | None:
        """The node id in the certificate of the node serving ``address`` (host:port), from a
        handshake of its own (remembered for NODE_AT_S); None on a plaintext transport.
        :class:`SecurityError` when it cannot be reached over TLS or its certificate is refused."""
        if self._client is None:
            return None
        now = time.monotonic()
        hit = self._nodes_at.get(address)
        if hit is not None and now - hit[1] < NODE_AT_S:
            return hit[0]
        host, _, port = address.rpartition(":")
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection(host, int(port), ssl=self._client), timeout)
        except (OSError, TimeoutError, ValueError) as e:
            raise SecurityError(f"no TLS handshake with {address}: {e}") from None
        try:
            node = self.peer(w.get_extra_info("ssl_object"))
        finally:
            w.close()
        if node is None:
            raise SecurityError(f"the node at {address} showed no certificate")
        self._nodes_at[address] = (node, now)
        return node

    def describe(self) -> str:
        if self.creds is None:
            return "plaintext"
        return f"mutual TLS, cluster {self.creds.cluster_id}, node {self.creds.node_id}"


PLAINTEXT = Transport()  # for plaintext lab clusters and tests (a node's own comes from choose())
# the transport of an app's port: what peer_middleware checks peers with (set where the app is built)
TRANSPORT_KEY = web.AppKey("transport", Transport)


def choose(insecure: bool = False, folder: Path | None = None, why: str = "--insecure") -> Transport:
    """Secure from the local credentials, or plaintext when ``insecure`` (``why``: who said so),
    logged loudly. Never plaintext by default: without credentials it raises :class:`NotMember`
    with :data:`NO_CLUSTER_HINT`; broken credentials raise :class:`SecurityError`."""
    if insecure:
        log.warning(PLAINTEXT_WARNING.format(why=why))
        return Transport()
    try:
        creds = Credentials.load(folder)
    except NotMember:
        raise NotMember(NO_CLUSTER_HINT) from None
    t = Transport(creds)
    log.info("node links: %s", t.describe())
    return t


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def peer_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """On a secure port: the peer's identity is its certificate (``request["peer"]``). The app
    says which transport its port serves (:data:`TRANSPORT_KEY`)."""
    t = request.config_dict[TRANSPORT_KEY]
    if t.secure:
        try:
            peer = t.peer(request.transport.get_extra_info("ssl_object") if request.transport else None)
        except SecurityError as e:
            log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote, e)
            return api_error(403, f"refused: {e}", "refused", "invalid_request_error")
        if peer is None and request.path not in PUBLIC_PATHS:
            log.warning("refused %s %s from %s: no node certificate", request.method, request.path, request.remote)
            return api_error(
                403, "a node certificate of this cluster is required", "no_certificate", "invalid_request_error"
            )
        if peer is not None:
            request["peer"] = peer
            conn = request.transport
            if conn is not None:  # a websocket lasts: closed if the peer is revoked meanwhile
                t.serving(peer, conn)
                try:
                    return await handler(request)
                finally:
                    t.served(peer, conn)
    return await handler(request)
