"""OpenAI-compatible API: ``/v1/models`` (and ``/v1/models/{id}``), ``/v1/chat/completions`` and the
legacy ``/v1/completions`` (a prompt as raw text, no chat template), both with SSE streaming and
one generation path. A chat completion with ``continue_final_message`` (vLLM's extension) goes on
with the final assistant message instead of answering after it.

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
from agent.runtime.tokenizer import NotContinuable
from coordinator.api import answers
from coordinator.api.answers import CHAT, TEXT, Shape
from coordinator.api.generation import Tally
from coordinator.api.limits import Refusal, client_key
from coordinator.api.requests import BadRequest, parse_chat_request, parse_text_request
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


# what the limits count: every path toward the rate, completions toward concurrency too
# (the event stream is long-lived and cheap: neither)
LIMITED = {"/v1/models": False, "/v1/chat/completions": True, "/v1/completions": True}


def _limited(path: str) -> bool | None:
    """Whether a request to ``path`` holds a concurrency slot (None: not limited at all)."""
    if path.startswith("/v1/models/"):
        return False
    return LIMITED.get(path)


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
    hold = _limited(request.path)
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


def _model(st: ApiState) -> dict[str, Any]:
    return {"id": st.model, "object": "model", "created": 0, "owned_by": "lakeshard"}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model(request.app[STATE])]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}``: the model served, or OpenAI's 404 for any other."""
    st = request.app[STATE]
    name = request.match_info["model"]
    if name != st.model:
        return _not_served(name, st)
    return web.json_response(_model(st))


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
        return error(400, "model must be a string", param="model")
    return _not_served(model, st)


def _not_served(model: str, st: ApiState) -> web.Response:
    return error(
        404, f"the model {model!r} does not exist here; served: {st.model}", code="model_not_found", param="model"
    )


def _unavailable(e: PipelineError) -> web.Response:
    """A request the batching ring cannot take: 503 with Retry-After while its queue is full; 400
    for a prompt no KV pool of the cluster could hold."""
    if e.code == "context_length_exceeded":
        return error(400, str(e), code=e.code)
    resp = error(503, f"the cluster is busy: {e}", "server_error", e.code)
    resp.headers["Retry-After"] = str(e.retry_after or 1)
    return resp


async def _body(request: web.Request) -> Any:
    """The request's JSON (BadRequest when it is not JSON)."""
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None


def _bad(e: BadRequest) -> web.Response:
    return error(400, str(e), code=e.code, param=e.param)


def _too_long(n: str, max_tokens: int, st: ApiState) -> web.Response:
    return error(
        400,
        f"prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the context of {st.context_limit}",
        code="context_length_exceeded",
        param="max_tokens",
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    try:
        body = await _body(request)
        bad_model = _model_error(body, st)
        if bad_model is not None:
            return bad_model
        msgs, opts = parse_chat_request(body, st.max_tokens_limit)
    except BadRequest as e:
        return _bad(e)
    at_least = st.tokenizer.min_tokens(msgs)
    if at_least + opts["max_tokens"] > st.context_limit:  # certain without tokenizing megabytes
        return _too_long(f"at least {at_least}", opts["max_tokens"], st)
    try:  # tokenizing takes seconds for megabytes
        ids = await asyncio.to_thread(st.tokenizer.chat_ids, msgs, opts["continue_final"])
    except NotContinuable as e:
        return error(400, f"continue_final_message: {e}", param="continue_final_message")
    return await _answer(request, st, CHAT, ids, opts)


async def text_completions(request: web.Request) -> web.StreamResponse:
    """The legacy ``/v1/completions``: the prompt is raw text, continued as it stands."""
    st = request.app[STATE]
    try:
        body = await _body(request)
        bad_model = _model_error(body, st)
        if bad_model is not None:
            return bad_model
        prompt, opts = parse_text_request(body, st.max_tokens_limit)
    except BadRequest as e:
        return _bad(e)
    at_least = st.tokenizer.min_tokens([{"content": prompt}])
    if at_least + opts["max_tokens"] > st.context_limit:
        return _too_long(f"at least {at_least}", opts["max_tokens"], st)
    ids = await asyncio.to_thread(st.tokenizer.text_ids, prompt)
    if not ids:
        return error(400, "prompt must not be empty", param="prompt")
    return await _answer(request, st, TEXT, ids, opts)


async def _answer(
    request: web.Request, st: ApiState, shape: Shape, ids: list[int], opts: dict[str, Any]
) -> web.StreamResponse:
    """Generate the answer to prompt ``ids``, whole or streamed, in ``shape``: what both kinds of
    completion share once their prompt is tokens."""
    if len(ids) + opts["max_tokens"] > st.context_limit:
        return _too_long(str(len(ids)), opts["max_tokens"], st)
    if isinstance(st.scheduler, Batcher) and (full := st.scheduler.refusal(len(ids))) is not None:
        return _unavailable(full)
    cid = f"{shape.prefix}{secrets.token_hex(12)}"
    tally = Tally(cid, continued=len(opts["continue"]))
    base = {"id": cid, "created": int(time.time()), "model": st.model}
    if st.events is not None:
        st.events.publish(StreamStarted(time.time(), cid, len(ids), opts["max_tokens"]))
    outcome = "cancelled"  # until it ends otherwise (a client that leaves cancels it)
    try:
        if opts["stream"]:
            resp, outcome = await answers.stream(request, st, shape, ids, opts, tally, base)
            return resp
        resp, outcome = await answers.whole(st, shape, ids, opts, tally, base)
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
    app.router.add_get("/v1/models/{model:.+}", model)  # a model id may hold a slash (org/name)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", text_completions)
    app.router.add_get("/v1/cluster/events", cluster_events)
    return app
