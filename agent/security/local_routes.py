"""Cluster identity on the agent's local API (127.0.0.1): what ``lakeshard cluster`` does, for the tray.

* ``POST /v1/cluster/init``: make a new cluster here (this node holds its CA);
* ``POST /v1/cluster/join`` ``{"token": "lsj1-..."}``: join the cluster a token names;
* ``POST /v1/cluster/invite`` ``{"expires": "24h", "uses": 1, "address": "host:port"}`` (all
  optional; the address defaults to this machine's LAN address and data port): a join token;
* ``POST /v1/cluster/revoke`` ``{"node": "0123456789ab"}``: revoke a node;
* ``GET /v1/cluster/identity``: what this node holds (``lakeshard cluster status --json``).

They answer only local programs: a request that names another host (DNS rebinding) or comes
from a web page (an ``Origin`` header: browsers send one with every POST) is refused with 403,
so no page the user visits can join this laptop to a cluster of its choosing.

Each calls :mod:`agent.security.cluster` off the event loop; a failure is its one-line message,
as the CLI prints it, in ``{"error": {"message", "type", "code"}}``: 409 ``not_in_cluster``,
``in_cluster`` or ``not_ca_holder`` where this node's membership does not allow it, else 400
``cluster_error``.
New credentials are handed to ``on_credentials``: the agent starts as a member at once (an
answer's ``agent_error`` says why it could not).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from agent.common.http import api_error, local_only
from agent.security import cluster, tokens
from agent.security.credentials import NotMember
from agent.security.errors import SecurityError

JOIN_TIMEOUT_S = 10.0


@dataclass
class Identity:
    """What the routes need of the agent."""

    node: Callable[[], str]  # this agent's node id (the one its certificate must name)
    address: Callable[[], str]  # host:port where joiners reach this agent (invites' default)
    on_credentials: Callable[[], Awaitable[str | None]]  # after init/join: start as a member (why not)
    folder: Path | None = None  # the security folder (None: the default)


IDENTITY: web.AppKey[Identity] = web.AppKey("identity")


def add_cluster_api(app: web.Application, ident: Identity) -> None:
    app[IDENTITY] = ident
    app.router.add_post("/v1/cluster/init", local_only(_init))
    app.router.add_post("/v1/cluster/join", local_only(_join))
    app.router.add_post("/v1/cluster/invite", local_only(_invite))
    app.router.add_post("/v1/cluster/revoke", local_only(_revoke))
    app.router.add_get("/v1/cluster/identity", local_only(_identity))


def _error(e: SecurityError) -> web.Response:
    msg = str(e)
    if isinstance(e, NotMember) or "not in a secured cluster" in msg:
        code, status = "not_in_cluster", 409
    elif "only a node that holds the cluster CA" in msg:
        code, status = "not_ca_holder", 409
    elif "already" in msg and ("cluster credentials" in msg or "in a cluster" in msg):
        code, status = "in_cluster", 409
    else:
        code, status = "cluster_error", 400
    return api_error(status, msg, code, "invalid_request_error")


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        d = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SecurityError("the body must be a JSON object") from None
    if not isinstance(d, dict):
        raise SecurityError("the body must be a JSON object")
    return d


def _text(d: dict[str, Any], key: str, default: str) -> str:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, str | int):
        raise SecurityError(f"{key}: {v!r} is not valid")
    return str(v)


async def _init(request: web.Request) -> web.Response:
    ident = request.app[IDENTITY]
    try:
        await _body(request)
        creds = await asyncio.to_thread(cluster.init_cluster, ident.node(), ident.folder)
    except SecurityError as e:
        return _error(e)
    why = await ident.on_credentials()
    st = await asyncio.to_thread(cluster.status, ident.folder)
    msg = f"cluster {creds.cluster_id}: made; node {creds.node_id} holds its CA and is its first member"
    return web.json_response({**st, "message": msg, "agent_error": why})


async def _join(request: web.Request) -> web.Response:
    ident = request.app[IDENTITY]
    try:
        token = (await _body(request)).get("token")
        if not isinstance(token, str) or not token.strip():
            raise SecurityError('give the token: {"token": "lsj1-..."} (from \'lakeshard cluster invite\')')
        creds = await asyncio.to_thread(
            cluster.join_cluster, token.strip(), ident.node(), ident.folder, timeout=JOIN_TIMEOUT_S
        )
    except SecurityError as e:
        return _error(e)
    why = await ident.on_credentials()
    st = await asyncio.to_thread(cluster.status, ident.folder)
    msg = (
        f"joined cluster {creds.cluster_id} as node {creds.node_id} (certificate valid until {creds.expires:%Y-%m-%d})"
    )
    return web.json_response({**st, "message": msg, "agent_error": why})


async def _invite(request: web.Request) -> web.Response:
    ident = request.app[IDENTITY]
    try:
        d = await _body(request)
        expires_text, uses_text = _text(d, "expires", "24h"), _text(d, "uses", "1")
        expires = int(expires_text) if expires_text.isdigit() else tokens.parse_duration(expires_text)
        uses = tokens.parse_uses(uses_text)
        address = d.get("address") or await asyncio.to_thread(ident.address)
        if not isinstance(address, str):
            raise SecurityError(f"address: {address!r} is not host:port")
        tokens.check_address(address)
        token = await asyncio.to_thread(cluster.invite, address, expires, uses, ident.folder)
    except SecurityError as e:
        return _error(e)
    plural = "s" if uses > 1 else ""
    hint = f"valid for {expires_text}, {uses} use{plural}, through {address}; on the new node: 'cluster join TOKEN'"
    return web.json_response({"token": token, "expires_s": expires, "uses": uses, "address": address, "message": hint})


async def _revoke(request: web.Request) -> web.Response:
    ident = request.app[IDENTITY]
    try:
        node = (await _body(request)).get("node")
        if not isinstance(node, str):
            raise SecurityError('give the node: {"node": "0123456789ab"}')
        before = (await asyncio.to_thread(cluster.status, ident.folder)).get("revocation_version")
        rl = await asyncio.to_thread(cluster.revoke, node, ident.folder)
    except SecurityError as e:
        return _error(e)
    already = rl.version == before
    if already:
        msg = f"node {node} was already revoked (revocation list version {rl.version})"
    else:
        msg = f"revoked node {node} (revocation list version {rl.version})"
    return web.json_response({"node": node, "version": rl.version, "already": already, "message": msg})


async def _identity(request: web.Request) -> web.Response:
    ident = request.app[IDENTITY]
    try:
        st = await asyncio.to_thread(cluster.status, ident.folder)
    except SecurityError as e:
        return _error(e)
    return web.json_response(st)
