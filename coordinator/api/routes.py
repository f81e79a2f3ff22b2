"""OpenAI-compatible API: ``/v1/models`` and ``/v1/chat/completions`` (with SSE streaming).

Listens on 127.0.0.1 unless configured otherwise; then a key is required. Requests are
limited per client (rate and concurrency, :mod:`coordinator.api.limits`) after authentication:
over a limit is a 429 with a ``Retry-After`` header. A client that disconnects mid-stream
cancels its generation, frees its stream on every stage and its concurrency slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Any

from aiohttp import web

from agent.api.events import async_serve_events
from agent.common.http import json_errors
from agent.protocol.events import StreamFinished, StreamStarted
from coordinator.api import answers
from coordinator.api.generation import Tally
from coordinator.api.limits import Refusal, client_key
from coordinator.api.requests import BadRequest, parse_chat_request
from coordinator.api.state import STATE, ApiState, error
from coordinator.batching.batcher import Batcher
from coordinator.ring.pipeline import PipelineError

log = logging.getLogger(__name__)


@web.middleware
async def auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if key and request.path.startswith("/v1/"):
        got = request.headers.get("Authorization", "")
        if not secrets.compare_digest(got, f"Bearer {key}"):
            return error(401, "missing or wrong API key", "authentication_error", "invalid_api_key")
    response: web.StreamResponse = await handler(request)
    return response


# what the limits count: every path toward the rate, chat completions toward concurrency too
# (the event stream is long-lived and cheap: neither)
LIMITED = {"/v1/models": False, "/v1/chat/completions": True}


def _refused(r: Refusal) -> web.Response:
    resp = error(429, r.message, "rate_limit_error", r.code)
    resp.headers["Retry-After"] = str(r.retry_after)
    return resp


@web.middleware
async def limit_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """After authentication: the client's rate, and a concurrency slot for a chat completion,
    held until its answer ends (a stream's last chunk, or the client leaving: aiohttp then
    cancels the handler, and the slot comes back here)."""
    lim = request.app[STATE].limiter
    hold = LIMITED.get(request.path)
    if lim is None or hold is None:
        response: web.StreamResponse = await handler(request)
        return response
    client = client_key(request.remote, request.headers.get("X-Forwarded-For"))
    refusal = lim.admit(client, hold=hold)
    if refusal is not None:
        log.info("%s %s from %s refused: %s", request.method, request.path, client, refusal.code)
        return _refused(refusal)
    if not hold:
        response = await handler(request)
        return response
    try:
        response = await handler(request)
        return response
    finally:
        lim.release(client)


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response(
        {"object": "list", "data": [{"id": st.model, "object": "model", "created": 0, "owned_by": "lakeshard"}]}
    )


async def cluster_events(request: web.Request) -> web.StreamResponse:
    hub = request.app[STATE].events
    if hub is None:
        return error(404, "this coordinator publishes no event stream", code="not_found")
    return await async_serve_events(request, hub)


def _model_error(body: Any, st: ApiState) -> web.Response | None:
    """OpenAI answers a model it does not serve with 404 ``model_not_found``; so do we."""
    model = body.get("model") if isinstance(body, dict) else None
    if model is None or model == st.model:
        return None
    if not isinstance(model, str):
        return error(400, "model must be a string")
    return error(404, f"the model {model!r} does not exist here; served: {st.model}", code="model_not_found")


def _unavailable(e: PipelineError) -> web.Response:
    """A request the batching ring cannot take: 503 with Retry-After while its queue is full; 400
    for a prompt no KV pool of the cluster could hold."""
    if e.code == "context_length_exceeded":
        return error(400, str(e), code=e.code)
    resp = error(503, f"the cluster is busy: {e}", "server_error", e.code)
    resp.headers["Retry-After"] = str(e.retry_after or 1)
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error(400, "the request body is not valid JSON")
    bad_model = _model_error(body, st)
    if bad_model is not None:
        return bad_model
    try:
        msgs, opts = parse_chat_request(body, st)
    except BadRequest as e:
        return error(400, str(e))
    at_least = st.tokenizer.min_tokens(msgs)
    if at_least + opts["max_tokens"] > st.context_limit:  # certain without tokenizing megabytes
        return error(
            400, f"prompt (at least {at_least} tokens) plus max_tokens exceeds the context of {st.context_limit}"
        )
    ids = await asyncio.to_thread(st.tokenizer.chat_ids, msgs)  # tokenizing takes seconds for megabytes
    if len(ids) + opts["max_tokens"] > st.context_limit:
        return error(400, f"prompt ({len(ids)} tokens) plus max_tokens exceeds the context of {st.context_limit}")
    if isinstance(st.scheduler, Batcher) and (full := st.scheduler.refusal(len(ids))) is not None:
        return _unavailable(full)
    so = body.get("stream_options")
    include_usage = isinstance(so, dict) and so.get("include_usage") is True
    cid = f"chatcmpl-{secrets.token_hex(12)}"
    tally = Tally(cid, continued=len(opts["continue"]))
    base = {"id": cid, "created": int(time.time()), "model": st.model}
    if st.events is not None:
        st.events.publish(StreamStarted(time.time(), cid, len(ids), opts["max_tokens"]))
    outcome = "cancelled"  # until it ends otherwise (a client that leaves cancels it)
    try:
        if opts["stream"]:
            resp, outcome = await answers.stream(request, st, ids, opts, tally, base, include_usage)
            return resp
        resp, outcome = await answers.whole(st, ids, opts, tally, base)
        return resp
    finally:
        if st.events is not None:
            st.events.publish(_finished(st, tally, outcome))


def _finished(st: ApiState, tally: Tally, outcome: str) -> StreamFinished:
    """The event stream's word that an answer ended (``outcome``: done, error or cancelled)."""
    return StreamFinished(
        time.time(),
        tally.stream,
        tally.tokens,
        round(time.perf_counter() - tally.t0, 4),
        tally.ttft_s,
        tally.tok_s,
        outcome,
        tuple(st.served_by()),
        tally.spec.proposed,
        tally.spec.accepted,
    )


def make_api_app(state: ApiState) -> web.Application:
    app = web.Application(middlewares=[json_errors, auth_middleware, limit_middleware], client_max_size=8 * 1024 * 1024)
    app[STATE] = state
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/cluster/events", cluster_events)
    return app
