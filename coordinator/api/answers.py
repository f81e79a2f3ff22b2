"""A chat completion's answer: whole (one JSON body once generation ends), or streamed as
server-sent events, chunk by chunk, with the ids behind each chunk for an agent's gateway that
may go on with the answer on another coordinator."""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

from aiohttp import web

from agent.api.resume import RESUME_HEADER
from coordinator.api.generation import Tally, tokens
from coordinator.api.state import ApiState, error
from coordinator.ring.pipeline import PipelineError

log = logging.getLogger(__name__)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def whole(
    st: ApiState, ids: list[int], opts: dict[str, Any], tally: Tally, base: dict[str, Any]
) -> tuple[web.Response, str]:
    parts, finish = [], "stop"
    try:
        async with contextlib.aclosing(tokens(st, ids, opts, tally)) as gen:
            async for piece, fin in gen:
                parts.append(piece)
                finish = fin or finish
    except PipelineError as e:
        resp = error(503, f"generation failed: {e}", "server_error", e.code)
        if e.retry_after is not None:
            resp.headers["Retry-After"] = str(e.retry_after)
        return resp, "error"
    body = {
        **base,
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)}, "finish_reason": finish}],
        "usage": _usage(len(ids), tally.completion),
        "lakeshard": tally.report(st.served_by()),
    }
    return web.json_response(body), "done"


async def stream(
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
        async with contextlib.aclosing(tokens(st, ids, opts, tally)) as gen:
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
