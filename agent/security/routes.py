"""The cluster identity routes on an agent's public data port. What they serve is public or
protected by the join protocol itself, so they answer a client without a node certificate too
(over TLS when the agent runs secure, see :mod:`agent.security.transport`; plain HTTP otherwise):

* ``GET /v1/cluster/ca``: ``{"cluster", "ca" (PEM), "node", "holds_ca"}``;
* ``POST /v1/cluster/join``: a join request (:func:`agent.security.join.answer_join`), on a CA
  holder; elsewhere 404 ``not_ca_holder`` naming the node that signed this one;
* ``GET /v1/cluster/revoked``: the signed revocation list (anyone may check it).

Credentials are read from the security folder on every request, so ``cluster init``, ``join`` or
``revoke`` take effect without restarting the agent. Errors are ``{"error": {"message", "type",
"code"}}`` like the rest of the agent's HTTP answers.
"""

from __future__ import annotations

import logging
from pathlib import Path

from aiohttp import web

from agent.common.http import api_error
from agent.security.ca_store import Refused
from agent.security.credentials import Credentials, NotMember
from agent.security.errors import SecurityError
from agent.security.join import MAX_BODY, answer_join

log = logging.getLogger(__name__)
FOLDER: web.AppKey[Path | None] = web.AppKey("security_folder")


def _creds(request: web.Request) -> Credentials | web.Response:
    try:
        return Credentials.load(request.app[FOLDER])
    except NotMember as e:
        return api_error(404, str(e), "not_in_cluster", "invalid_request_error")
    except SecurityError as e:
        log.warning("cluster credentials unusable: %s", e)
        return api_error(503, f"this node's cluster credentials are unusable: {e}", "credentials_broken")


async def async_ca(request: web.Request) -> web.Response:
    creds = _creds(request)
    if isinstance(creds, web.Response):
        return creds
    from agent.security.pki import cert_pem

    body = {
        "cluster": creds.cluster_id,
        "ca": cert_pem(creds.ca_cert).decode(),
        "node": creds.node_id,
        "holds_ca": creds.holds_ca,
    }
    return web.json_response(body)


async def async_revoked(request: web.Request) -> web.Response:
    creds = _creds(request)
    if isinstance(creds, web.Response):
        return creds
    if creds.revoked is None:
        return api_error(404, "this node holds no revocation list yet", "no_revocation_list")
    return web.json_response(creds.revoked.to_json())


async def async_join(request: web.Request) -> web.Response:
    n = request.content_length
    if n is None:
        return api_error(411, "a join request needs a Content-Length", "length_required", "invalid_request_error")
    if n > MAX_BODY:
        return api_error(
            413, f"a join request is at most {MAX_BODY} bytes", "request_too_large", "invalid_request_error"
        )
    body = await request.read()
    creds = _creds(request)
    if isinstance(creds, web.Response):
        return creds
    # no await from here on: checking the token and spending its use happen in one step
    try:
        answer = answer_join(creds, body)
    except Refused as e:
        log.info("join refused (%s) from %s: %s", e.code, request.remote, e)
        kind = "auth_error" if e.status in (403, 410) else "invalid_request_error"
        return api_error(e.status, str(e), e.code, kind)
    except SecurityError as e:
        log.warning("join failed: %s", e)
        return api_error(500, str(e), "join_failed")
    log.info("node %s joined cluster %s (from %s)", answer["node"], creds.cluster_id, request.remote)
    return web.json_response(answer)


def add_cluster_routes(app: web.Application, folder: Path | None = None) -> None:
    """Serve the routes above on ``app`` from ``folder`` (default: the security folder)."""
    app[FOLDER] = folder
    app.router.add_get("/v1/cluster/ca", async_ca)
    app.router.add_post("/v1/cluster/join", async_join)
    app.router.add_get("/v1/cluster/revoked", async_revoked)


def membership(node: str, folder: Path | None = None) -> str:
    """A log line on this agent's cluster credentials (and whether they name this agent's node id)."""
    try:
        creds = Credentials.load(folder)
    except NotMember:
        return "no cluster credentials (lakeshard cluster init / join)"
    except SecurityError as e:
        return f"cluster credentials unusable: {e}"
    role = "holds the CA" if creds.holds_ca else "member"
    line = f"cluster {creds.cluster_id}: {role}, certificate for node {creds.node_id}"
    if creds.node_id != node:
        line += f" (this agent is node {node}: its certificate names another node id)"
    return line
