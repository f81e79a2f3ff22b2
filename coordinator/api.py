"""OpenAI-compatible API: ``/v1/models`` and ``/v1/chat/completions`` (with SSE streaming).

Listens on 127.0.0.1 unless configured otherwise; then a key is required. A client that
disconnects mid-stream cancels its generation and frees its stream on every stage.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from agent.protocol import SamplingSpec
from agent.runtime.tokenizer import ChatTokenizer
from coordinator.pipeline import PipelineError
from coordinator.scheduler import GenRequest, Scheduler

log = logging.getLogger(__name__)


@dataclass
class ApiState:
    model: str
    tokenizer: ChatTokenizer
    scheduler: Scheduler
    api_key: str | None = None
    max_tokens_limit: int = 8192
    context_limit: int = 32768


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


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response(
        {"object": "list", "data": [{"id": st.model, "object": "model", "created": 0, "owned_by": "lakeshard"}]}
    )


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
    opts = {
        "max_tokens": max_tokens,
        "temperature": _num(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _num(body, "top_p", 1.0, 1e-6, 1.0),
        "seed": seed,
        "stop": [s for s in stops if s],
        "stream": bool(body.get("stream", False)),
    }
    return clean, opts


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


async def _tokens(st: ApiState, ids: list[int], opts: dict[str, Any]) -> AsyncIterator[tuple[str, str | None]]:
    """(text delta, finish reason once at the end)."""
    req = GenRequest(
        prompt=tuple(ids),
        max_tokens=opts["max_tokens"],
        sampling=SamplingSpec(opts["temperature"], opts["top_p"], opts["seed"]),
        stop_ids=st.tokenizer.stop_ids,
    )
    dec = st.tokenizer.stream()
    stop = StopMatcher(opts["stop"])
    n = 0
    gen = st.scheduler.async_generate(req)
    try:
        async for tok in gen:
            n += 1
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


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "the request body is not valid JSON")
    try:
        msgs, opts = parse_chat_request(body, st)
        ids = st.tokenizer.chat_ids(msgs)
    except BadRequest as e:
        return _error(400, str(e))
    if len(ids) + opts["max_tokens"] > st.context_limit:
        return _error(400, f"prompt ({len(ids)} tokens) plus max_tokens exceeds the context of {st.context_limit}")
    cid = f"chatcmpl-{secrets.token_hex(12)}"
    created = int(time.time())
    base = {"id": cid, "created": created, "model": st.model}
    if not opts["stream"]:
        parts, finish = [], "stop"
        try:
            async for piece, fin in _tokens(st, ids, opts):
                parts.append(piece)
                finish = fin or finish
        except PipelineError as e:
            return _error(503, f"generation failed: {e}", "server_error", e.code)
        text = "".join(parts)
        usage_out = len(st.tokenizer.encode(text)) if text else 0
        return web.json_response(
            {
                **base,
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                "usage": {
                    "prompt_tokens": len(ids),
                    "completion_tokens": usage_out,
                    "total_tokens": len(ids) + usage_out,
                },
            }
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(delta: dict[str, Any], finish: str | None = None) -> None:
        chunk = {
            **base,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

    try:
        await send({"role": "assistant", "content": ""})
        async for piece, fin in _tokens(st, ids, opts):
            if piece:
                await send({"content": piece})
            if fin:
                await send({}, fin)
        await resp.write(b"data: [DONE]\n\n")
    except PipelineError as e:
        err = {"error": {"message": f"generation failed: {e}", "type": "server_error", "code": e.code}}
        await resp.write(f"data: {json.dumps(err)}\n\n".encode())
    except (ConnectionResetError, ConnectionError):
        log.info("client went away: generation %s cancelled", cid)
    return resp


def make_api_app(state: ApiState) -> web.Application:
    app = web.Application(middlewares=[auth_middleware], client_max_size=8 * 1024 * 1024)
    app[STATE] = state
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app
