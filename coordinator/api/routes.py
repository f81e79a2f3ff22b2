"""OpenAI-compatible API: ``/v1/models`` and ``/v1/chat/completions`` (with SSE streaming).

Listens on 127.0.0.1 unless configured otherwise; then a key is required. Requests are
limited per client (rate and concurrency, :mod:`coordinator.api.limits`) after authentication:
over a limit is a 429 with a ``Retry-After`` header. A client that disconnects mid-stream
cancels its generation, frees its stream on every stage and its concurrency slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from agent.api.events import EventHub, async_serve_events
from agent.api.resume import RESUME_HEADER
from agent.common.http import json_errors
from agent.protocol import SamplingSpec
from agent.protocol.events import StreamFinished, StreamStarted
from agent.runtime.tokenizer import ChatTokenizer
from coordinator.api.limits import Limiter, Refusal, client_key
from coordinator.batching.scheduler import GenRequest, Scheduler
from coordinator.ring.pipeline import PipelineError
from coordinator.speculative.decoding import SpecCounters

log = logging.getLogger(__name__)


@dataclass
class ApiState:
    model: str
    tokenizer: ChatTokenizer
    scheduler: Scheduler
    api_key: str | None = None
    max_tokens_limit: int = 8192
    context_limit: int = 32768
    events: EventHub | None = None  # the cluster event stream (streams started and finished)
    served_by: Callable[[], list[str]] = field(default=lambda: [])  # the plan's nodes, in stage order
    limiter: Limiter | None = None  # request limits per client (None: none)


STATE = web.AppKey("api_state", ApiState)


class BadRequest(ValueError):
    pass


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": code}}, status=status)


@web.middleware
async def auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if key and request.path.startswith("/v1/"):
        got = request.headers.get("Authorization", "")
        if not secrets.compare_digest(got, f"Bearer {key}"):
            return _error(401, "missing or wrong API key", "authentication_error", "invalid_api_key")
    response: web.StreamResponse = await handler(request)
    return response


# what the limits count: every path toward the rate, chat completions toward concurrency too
# (the event stream is long-lived and cheap: neither)
LIMITED = {"/v1/models": False, "/v1/chat/completions": True}


def _refused(r: Refusal) -> web.Response:
    resp = _error(429, r.message, "rate_limit_error", r.code)
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
        return _error(404, "this coordinator publishes no event stream", code="not_found")
    return await async_serve_events(request, hub)


def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not (lo <= v <= hi):
        raise BadRequest(f"{key} must be a number between {lo} and {hi}")
    return float(v)


def parse_chat_request(body: Any, st: ApiState) -> tuple[list[dict[str, str]], dict[str, Any]]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list")
    clean = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise BadRequest("each message needs a role of system, user or assistant")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise BadRequest("message content must be a string")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = 512
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not (1 <= max_tokens <= st.max_tokens_limit):
        raise BadRequest(f"max_tokens must be an integer between 1 and {st.max_tokens_limit}")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = list(stop)
    else:
        raise BadRequest("stop must be a string or a list of at most 4 strings")
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbelow(2**31)
    if isinstance(seed, bool) or not isinstance(seed, int) or not (0 <= seed < 2**63):
        raise BadRequest("seed must be a non-negative integer")
    cont, sent = _continuation(body.get("lakeshard"), max_tokens)
    opts = {
        "continue": cont,  # token ids already generated (a gateway going on after a lost coordinator)
        "sent": sent,  # characters of them the client has already been sent
        "max_tokens": max_tokens,
        "temperature": _num(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _num(body, "top_p", 1.0, 1e-6, 1.0),
        "seed": seed,
        "stop": [s for s in stops if s],
        "stream": bool(body.get("stream", False)),
    }
    return clean, opts


MAX_CONTINUE = 1 << 17


def _continuation(v: Any, max_tokens: int) -> tuple[tuple[int, ...], int]:
    """``lakeshard.continue`` (ids generated so far) and ``lakeshard.sent`` (characters the client
    has), which an agent's gateway sends to go on with an answer whose coordinator was lost."""
    if v is None:
        return (), 0
    if not isinstance(v, dict):
        raise BadRequest("lakeshard must be an object")
    ids, sent = v.get("continue", []), v.get("sent", 0)
    if not isinstance(ids, list) or len(ids) > min(max_tokens, MAX_CONTINUE):
        raise BadRequest("lakeshard.continue must be a list of at most max_tokens token ids")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in ids):
        raise BadRequest("lakeshard.continue must hold token ids")
    if isinstance(sent, bool) or not isinstance(sent, int) or sent < 0:
        raise BadRequest("lakeshard.sent must be a count of characters")
    return tuple(ids), sent


class StopMatcher:
    """Cuts the text at the first stop string; holds back what could still become one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, delta: str) -> str:
        self.text += delta
        for s in self.stops:
            i = self.text.find(s)
            if i >= 0:
                self.stopped = True
                out = self.text[self.sent : i]
                self.sent = i
                return out
        safe = len(self.text) - self.hold if self.stops else len(self.text)
        out = self.text[self.sent : max(self.sent, safe)]
        self.sent += len(out)
        return out

    def flush(self) -> str:
        if self.stopped:
            return ""
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out


@dataclass
class Tally:
    """One answer's figures: what the client is told (``lakeshard`` field) and the event stream."""

    stream: str
    t0: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    spec: SpecCounters = field(default_factory=SpecCounters)  # this answer's speculation
    ids: list[int] = field(default_factory=list)  # the tokens generated, in order
    continued: int = 0  # tokens a lost coordinator generated before this one went on

    @property
    def completion(self) -> int:
        return self.continued + self.tokens

    def token(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens += 1

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else round(self.first - self.t0, 4)

    @property
    def tok_s(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2 or self.last <= self.first:
            return None
        return round((self.tokens - 1) / (self.last - self.first), 2)

    def report(self, nodes: list[str]) -> dict[str, Any]:
        spec = self.spec.summary() if self.spec.rounds or self.spec.ring_tokens else None
        return {
            "ttft_s": self.ttft_s,
            "tok_s": self.tok_s,
            "completion_tokens": self.completion,
            "nodes": nodes,
            "speculation": spec,  # None: this answer was decoded plainly
        }


async def _tokens(
    st: ApiState, ids: list[int], opts: dict[str, Any], tally: Tally
) -> AsyncGenerator[tuple[str, str | None], None]:
    """(text delta, finish reason once at the end)."""
    cont: tuple[int, ...] = opts.get("continue", ())
    req = GenRequest(
        prompt=(*ids, *cont),
        max_tokens=opts["max_tokens"] - len(cont),
        sampling=SamplingSpec(opts["temperature"], opts["top_p"], opts["seed"]),
        stop_ids=st.tokenizer.stop_ids,
        spec_counters=tally.spec,
    )
    dec = st.tokenizer.stream()
    stop = StopMatcher(opts["stop"])
    n = len(cont)
    for tok in cont:  # the text so far, as the lost coordinator had it; the client has ``sent`` of it
        stop.push(dec.push(tok))
    stop.sent = min(opts.get("sent", 0), len(stop.text))
    if stop.stopped or n >= opts["max_tokens"] or (cont and cont[-1] in req.stop_ids):
        yield "", "stop" if n < opts["max_tokens"] else "length"
        return
    gen = st.scheduler.async_generate(req)
    try:
        async for tok in gen:
            n += 1
            tally.token()
            tally.ids.append(tok)
            piece = stop.push(dec.push(tok))
            if piece:
                yield piece, None
            if stop.stopped:
                yield "", "stop"
                return
    finally:
        await gen.aclose()
    tail = stop.flush()
    if tail:
        yield tail, None
    yield "", "length" if n >= opts["max_tokens"] else "stop"


def _model_error(body: Any, st: ApiState) -> web.Response | None:
    """OpenAI answers a model it does not serve with 404 ``model_not_found``; so do we."""
    model = body.get("model") if isinstance(body, dict) else None
    if model is None or model == st.model:
        return None
    if not isinstance(model, str):
        return _error(400, "model must be a string")
    return _error(404, f"the model {model!r} does not exist here; served: {st.model}", code="model_not_found")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "the request body is not valid JSON")
    bad_model = _model_error(body, st)
    if bad_model is not None:
        return bad_model
    try:
        msgs, opts = parse_chat_request(body, st)
    except BadRequest as e:
        return _error(400, str(e))
    at_least = st.tokenizer.min_tokens(msgs)
    if at_least + opts["max_tokens"] > st.context_limit:  # certain without tokenizing megabytes
        return _error(
            400, f"prompt (at least {at_least} tokens) plus max_tokens exceeds the context of {st.context_limit}"
        )
    ids = await asyncio.to_thread(st.tokenizer.chat_ids, msgs)  # tokenizing takes seconds for megabytes
    if len(ids) + opts["max_tokens"] > st.context_limit:
        return _error(400, f"prompt ({len(ids)} tokens) plus max_tokens exceeds the context of {st.context_limit}")
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
            resp, outcome = await _stream(request, st, ids, opts, tally, base, include_usage)
            return resp
        resp, outcome = await _whole(st, ids, opts, tally, base)
        return resp
    finally:
        if st.events is not None:
            st.events.publish(
                StreamFinished(
                    time.time(),
                    cid,
                    tally.tokens,
                    round(time.perf_counter() - tally.t0, 4),
                    tally.ttft_s,
                    tally.tok_s,
                    outcome,
                    tuple(st.served_by()),
                    tally.spec.proposed,
                    tally.spec.accepted,
                )
            )


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _whole(
    st: ApiState, ids: list[int], opts: dict[str, Any], tally: Tally, base: dict[str, Any]
) -> tuple[web.Response, str]:
    parts, finish = [], "stop"
    try:
        async with contextlib.aclosing(_tokens(st, ids, opts, tally)) as gen:
            async for piece, fin in gen:
                parts.append(piece)
                finish = fin or finish
    except PipelineError as e:
        return _error(503, f"generation failed: {e}", "server_error", e.code), "error"
    body = {
        **base,
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)}, "finish_reason": finish}],
        "usage": _usage(len(ids), tally.completion),
        "lakeshard": tally.report(st.served_by()),
    }
    return web.json_response(body), "done"


async def _stream(
    request: web.Request,
    st: ApiState,
    ids: list[int],
    opts: dict[str, Any],
    tally: Tally,
    base: dict[str, Any],
    include_usage: bool,
) -> tuple[web.StreamResponse, str]:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    # an agent's gateway asks for the ids behind each chunk and the seed: to go on with this answer
    # on the next coordinator if this one is lost (see agent/api/resume.py)
    resume = request.headers.get(RESUME_HEADER) == "1"
    told = 0  # ids told so far

    async def send(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> None:
        nonlocal told
        chunk = {
            **base,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            **extra,
        }
        if resume:
            lk = chunk.setdefault("lakeshard", {})
            lk["ids"], told = tally.ids[told:], len(tally.ids)
            if delta.get("role"):
                lk["seed"] = opts["seed"]
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

    try:
        await send({"role": "assistant", "content": ""})
        async with contextlib.aclosing(_tokens(st, ids, opts, tally)) as gen:
            async for piece, fin in gen:
                if piece:
                    await send({"content": piece})
                if fin:
                    await send({}, fin, lakeshard=tally.report(st.served_by()))
        if include_usage:
            usage = {
                **base,
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": _usage(len(ids), tally.completion),
            }
            await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
    except PipelineError as e:
        err = {"error": {"message": f"generation failed: {e}", "type": "server_error", "code": e.code}}
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write(f"data: {json.dumps(err)}\n\n".encode())
        return resp, "error"
    except (ConnectionResetError, ConnectionError):
        log.info("client went away: generation %s cancelled", tally.stream)
        return resp, "cancelled"
    return resp, "done"


def make_api_app(state: ApiState) -> web.Application:
    app = web.Application(middlewares=[json_errors, auth_middleware, limit_middleware], client_max_size=8 * 1024 * 1024)
    app[STATE] = state
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/cluster/events", cluster_events)
    return app
