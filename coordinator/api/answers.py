"""An answer, whole (one JSON body once generation ends) or streamed as server-sent events, chunk
by chunk, in either shape: a chat completion's, or a legacy text completion's (:class:`Shape`).
A streamed chat answer carries the ids behind each chunk for an agent's gateway that may go on
with it on another coordinator. Where the request asked for log-probabilities, the choice (or
each chunk) carries those of its tokens, in the shape's own format (:mod:`.logprobs`)."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from agent.api.resume import RESUME_HEADER
from coordinator.api.generation import Tally, tokens
from coordinator.api.logprobs import Scored, TokenBytes, chat_logprobs, text_logprobs
from coordinator.api.state import ApiState, error
from coordinator.ring.pipeline import PipelineError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    """How one kind of completion answers: the objects of its body and chunks, and its choice."""

    kind: str  # "chat" or "text"
    prefix: str  # of its id: chatcmpl- or cmpl-
    whole_object: str
    chunk_object: str

    def logprobs(self, scored: list[Scored] | None, tok: TokenBytes) -> dict[str, Any] | None:
        """Tokens' log-probabilities in this shape's format (None: not asked, or no tokens in a chunk)."""
        if scored is None:
            return None
        return chat_logprobs(scored, tok) if self.kind == "chat" else text_logprobs(scored, tok)

    def choice(self, text: str, finish: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """The one choice of a whole answer (``logprobs``: its tokens', when asked)."""
        if self.kind == "chat":
            c = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            return c if logprobs is None else {**c, "logprobs": logprobs}
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def delta(
        self, text: str | None, finish: str | None = None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The one choice of a streamed chunk (chat: ``text`` None is the opening chunk's role;
        ``logprobs``: the log-probabilities of the tokens it says, when asked)."""
        if self.kind == "chat":
            d = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
            c = {"index": 0, "delta": d, "finish_reason": finish}
            return c if logprobs is None else {**c, "logprobs": logprobs}
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    @property
    def opens(self) -> bool:
        """Whether a stream begins with a chunk of its own (a chat's, which names the role)."""
        return self.kind == "chat"


CHAT = Shape("chat", "chatcmpl-", "chat.completion", "chat.completion.chunk")
TEXT = Shape("text", "cmpl-", "text_completion", "text_completion")


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def whole(
    st: ApiState, shape: Shape, ids: list[int], opts: dict[str, Any], tally: Tally, base: dict[str, Any]
) -> tuple[web.Response, str]:
    parts, finish = [], "stop"
    scored: list[Scored] | None = [] if opts.get("logprobs") is not None else None
    try:
        async with contextlib.aclosing(tokens(st, ids, opts, tally)) as gen:
            async for piece in gen:
                parts.append(piece.text)
                finish = piece.finish or finish
                if scored is not None:
                    scored += piece.scored
    except PipelineError as e:
        resp = error(503, f"generation failed: {e}", "server_error", e.code)
        if e.retry_after is not None:
            resp.headers["Retry-After"] = str(e.retry_after)
        return resp, "error"
    body = {
        **base,
        "object": shape.whole_object,
        "choices": [shape.choice("".join(parts), finish, shape.logprobs(scored, st.tokenizer))],
        "usage": _usage(len(ids), tally.completion),
        "lakeshard": tally.report(st.served_by()),
    }
    return web.json_response(body), "done"


async def stream(
    request: web.Request,
    st: ApiState,
    shape: Shape,
    ids: list[int],
    opts: dict[str, Any],
    tally: Tally,
    base: dict[str, Any],
) -> tuple[web.StreamResponse, str]:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    # an agent's gateway asks for the ids behind each chunk and the seed: to go on with this answer
    # on the next coordinator if this one is lost (see agent/api/resume.py)
    resume = request.headers.get(RESUME_HEADER) == "1"
    told = 0  # ids told so far
    asked = opts.get("logprobs") is not None

    async def send(choice: dict[str, Any], first: bool = False, **extra: Any) -> None:
        nonlocal told
        chunk = {**base, "object": shape.chunk_object, "choices": [choice], **extra}
        if resume:
            lk = chunk.setdefault("lakeshard", {})
            lk["ids"], told = tally.ids[told:], len(tally.ids)
            if first:
                lk["seed"] = opts["seed"]
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

    try:
        if shape.opens:
            await send(shape.delta(None), first=True)
        async with contextlib.aclosing(tokens(st, ids, opts, tally)) as gen:
            async for piece in gen:
                lp = shape.logprobs(list(piece.scored), st.tokenizer) if asked and piece.scored else None
                if piece.text:
                    await send(shape.delta(piece.text, logprobs=lp))
                if piece.finish:
                    tail = None if piece.text else lp  # tokens said with no text of their own: with the last chunk
                    await send(shape.delta("", piece.finish, tail), lakeshard=tally.report(st.served_by()))
        if opts["include_usage"]:
            usage = {
                **base,
                "object": shape.chunk_object,
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
