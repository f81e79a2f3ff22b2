"""An answer outlives its coordinator: the local gateway continues it on the next one.

The tray (and any client of an agent's 127.0.0.1 API) asks its own agent, which forwards to the
coordinator (:mod:`agent.api.gateway`). For a streamed chat answer the gateway asks the coordinator
to say, in each chunk, the token ids behind it and the sampling seed (``X-Lakeshard-Resume``),
and keeps them with the count of characters it has passed on. When the coordinator's stream
breaks before the answer ended (the coordinator died, or its link did), the gateway waits for
the cluster to answer again (a new coordinator is elected and takes over the running plan),
sends the same request with a continuation (``lakeshard.continue``: the ids so far;
``lakeshard.sent``: the characters already shown; the seed), and splices what comes back into
the same client stream: same completion id, no second role chunk, no repeated text. Greedy and
seeded sampling depend only on the position, so the text is the one an undisturbed run gives.
While it waits, the client gets one ``{"choices": [], "lakeshard": {"status": ...}}`` chunk
(OpenAI clients take a chunk without choices, as they do usage chunks).

A request that was not streamed is sent again whole when its connection breaks. Clients of the
coordinator's own API (not through an agent) get the broken connection as it is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from agent.common.http import api_error

log = logging.getLogger(__name__)
RESUME_HEADER = "X-Lakeshard-Resume"
RESUME_WAIT_S = 90.0  # how long an answer waits for the cluster to answer again
RETRY_S = 0.25
STATUS_LOST = "interrupted: the coordinator was lost; continuing on the next one…"
BROKEN = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError, OSError)

# (body, headers) -> the coordinator's response, or the gateway's own answer when there is no
# coordinator to ask now (none elected, not serving yet, a wrong certificate)
Upstream = Callable[[bytes, dict[str, str]], Awaitable[aiohttp.ClientResponse | web.Response]]


@dataclass
class Answer:
    """What the client has been sent of one streamed answer."""

    ids: list[int] = field(default_factory=list)  # token ids behind the text sent
    sent: int = 0  # characters of content passed on
    seed: int | None = None
    id: str | None = None  # the completion id the client saw first
    created: int | None = None
    finished: bool = False  # a chunk with a finish reason was passed on
    done: bool = False  # [DONE] was passed on
    resumed: int = 0
    said_lost: bool = False

    def continuation(self, body: dict[str, Any]) -> bytes:
        """The request again, asking to go on after what was sent."""
        b = dict(body)
        if self.seed is not None:
            b["seed"] = self.seed
        if self.ids or self.sent:  # (what else the client asked of ``lakeshard`` stays asked)
            asked = b.get("lakeshard")
            own = asked if isinstance(asked, dict) else {}
            b["lakeshard"] = {**own, "continue": list(self.ids), "sent": self.sent}
        return json.dumps(b).encode()

    def take(self, obj: dict[str, Any], continuing: bool, keep_ids: bool = False) -> dict[str, Any] | None:
        """One chunk from the coordinator, as the client is to get it (None: skip it). The ids and
        seed are taken out, unless the client asked for them itself (``keep_ids``)."""
        lk = obj.get("lakeshard")
        if isinstance(lk, dict):
            ids = lk.get("ids") if keep_ids else lk.pop("ids", None)
            if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                self.ids.extend(ids)
            seed = lk.get("seed") if keep_ids else lk.pop("seed", None)
            if isinstance(seed, int) and not isinstance(seed, bool) and self.seed is None:
                self.seed = seed
            if not lk:
                obj.pop("lakeshard")
        if self.id is None:
            self.id, self.created = obj.get("id"), obj.get("created")
        elif "id" in obj:
            obj["id"], obj["created"] = self.id, self.created
        for ch in obj.get("choices") or []:
            if not isinstance(ch, dict):
                continue
            delta = ch.get("delta") or {}
            if continuing and delta.get("role") and not delta.get("content") and not ch.get("finish_reason"):
                return None  # the continuation's opening chunk: the client has had one
            content = delta.get("content")
            if isinstance(content, str):
                self.sent += len(content)
            if ch.get("finish_reason"):
                self.finished = True
        return obj


def _events(buffer: bytearray) -> list[bytes]:
    """Whole SSE events taken off the front of ``buffer`` (their ``data:`` payloads)."""
    out: list[bytes] = []
    while True:
        i = buffer.find(b"\n\n")
        if i < 0:
            return out
        event = bytes(buffer[:i])
        del buffer[: i + 2]
        data = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))


async def async_stream_with_resume(
    request: web.Request,
    body: dict[str, Any],
    headers: dict[str, str],
    upstream: Upstream,
    stopping: Callable[[], bool] = lambda: False,
) -> web.StreamResponse:
    """Stream one chat answer to ``request``'s client, continuing it on the next coordinator when
    the stream breaks before its end, or when the coordinator says it is shutting down (a laptop
    switched off: its last word is an error chunk with code ``shutdown``), unless this agent is
    stopping too (``stopping``), when the client gets that chunk as it is."""
    hdrs = {**headers, RESUME_HEADER: "1"}
    try:
        first = await upstream(json.dumps(body).encode(), hdrs)
    except BROKEN as e:
        return _no_coordinator(str(e) or type(e).__name__)
    if isinstance(first, web.Response):
        return first  # no coordinator, or not serving yet: the gateway's own answer
    if first.status != 200:
        return await _as_is(first)  # a bad request, a refusal, a limit: the coordinator's answer as it is
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    ans = Answer()
    up: aiohttp.ClientResponse | None = first
    try:
        await _write(out.prepare(request))
        while True:
            why = ""
            if up is not None:
                try:
                    keep = request.headers.get(RESUME_HEADER) == "1"
                    if await _relay(up, out, ans, ans.resumed > 0, keep, stopping):
                        return out
                except BROKEN as e:
                    why = str(e) or type(e).__name__
                finally:
                    up.close()
                if ans.finished:  # only the closing [DONE] was lost
                    await _write(out.write(b"data: [DONE]\n\n"))
                    return out
                why = why or "the stream ended early"
                log.warning(
                    "the coordinator's stream broke after %d tokens (%s); going on with the next", len(ans.ids), why
                )
                if not ans.said_lost:
                    ans.said_lost = True
                    note: dict[str, Any] = {
                        "id": ans.id,
                        "object": "chat.completion.chunk",
                        "choices": [],
                        "lakeshard": {"status": STATUS_LOST},
                    }
                    await _write(out.write(f"data: {json.dumps(note)}\n\n".encode()))
                ans.resumed += 1
            up, why = await _next(upstream, ans.continuation(body), hdrs, time.monotonic() + RESUME_WAIT_S)
            if up is None:
                err = f"the answer was interrupted: no coordinator answered within {RESUME_WAIT_S:.0f} s ({why})"
                error = {"error": {"message": err, "type": "server_error", "code": "coordinator_lost"}}
                await _write(out.write(f"data: {json.dumps(error)}\n\n".encode()))
                return out
    except ClientGone:
        log.info("client of a streamed answer went away; forwarded request closed")
        if up is not None:
            up.close()
        return out


async def _next(
    upstream: Upstream, body: bytes, hdrs: dict[str, str], deadline: float
) -> tuple[aiohttp.ClientResponse | None, str]:
    """The continuation's stream, once a coordinator takes it (None after ``deadline``, and why)."""
    why = "no coordinator answers"
    while time.monotonic() < deadline:
        try:
            up = await upstream(body, hdrs)
        except BROKEN as e:
            why = str(e) or type(e).__name__
        else:
            if not isinstance(up, web.Response) and up.status == 200:
                return up, ""
            why = up.text or why if isinstance(up, web.Response) else f"HTTP {up.status}"
            if not isinstance(up, web.Response):
                if up.status not in (502, 503):  # refused for good (the continuation itself is wrong)
                    why = (await up.read())[:300].decode(errors="replace")
                    up.release()
                    return None, why
                up.release()
        await asyncio.sleep(RETRY_S)
    return None, why


class ClientGone(Exception):
    """Our own client left (writing to it failed): the forwarded request is closed, nothing resumed."""


async def _write(aw: Awaitable[Any]) -> None:
    try:
        await aw
    except (ConnectionError, RuntimeError) as e:  # aiohttp's "cannot write to closing transport" too
        raise ClientGone() from e


async def _relay(
    up: aiohttp.ClientResponse,
    out: web.StreamResponse,
    ans: Answer,
    continuing: bool,
    keep_ids: bool,
    stopping: Callable[[], bool],
) -> bool:
    """Pass the coordinator's events on; whether the answer ended ([DONE] or an error event;
    False: the stream broke, or the coordinator is shutting down while this agent is not)."""
    buf = bytearray()
    async for chunk in up.content.iter_any():
        buf.extend(chunk)
        for data in _events(buf):
            if data == b"[DONE]":
                await _write(out.write(b"data: [DONE]\n\n"))
                ans.done = True
                return True
            try:
                obj = json.loads(data)
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            if "error" in obj:  # the coordinator's own verdict (the generation failed): the client's too
                err = obj["error"]
                if isinstance(err, dict) and err.get("code") == "shutdown" and not stopping():
                    return False  # its laptop is going away: the next coordinator goes on
                await _write(out.write(b"data: " + data + b"\n\n"))
                return True
            taken = ans.take(obj, continuing, keep_ids)
            if taken is not None:
                await _write(out.write(f"data: {json.dumps(taken)}\n\n".encode()))
    return False


def _no_coordinator(why: str) -> web.Response:
    return api_error(503, f"the coordinator did not answer: {why}", "no_coordinator")


async def _as_is(up: aiohttp.ClientResponse) -> web.StreamResponse:
    body = await up.read()
    resp = web.Response(status=up.status, body=body, content_type=up.content_type or "application/json")
    if "Retry-After" in up.headers:
        resp.headers["Retry-After"] = up.headers["Retry-After"]
    up.release()
    return resp


async def async_whole_with_retry(body: bytes, headers: dict[str, str], upstream: Upstream) -> web.StreamResponse:
    """A chat answer that is not streamed: sent again whole when the connection to the coordinator
    breaks before the answer came. Until then it is forwarded as it is."""
    deadline: float | None = None
    while True:
        try:
            up = await upstream(body, headers)
            if deadline is None and isinstance(up, web.Response):
                return up
            if not isinstance(up, web.Response):
                if deadline is None or up.status not in (502, 503):
                    return await _as_is(up)
                up.release()
            why = f"HTTP {up.status}"
        except BROKEN as e:
            why = str(e) or type(e).__name__
        deadline = deadline or time.monotonic() + RESUME_WAIT_S
        if time.monotonic() > deadline:
            return _no_coordinator(f"none answered within {RESUME_WAIT_S:.0f} s ({why})")
        await asyncio.sleep(RETRY_S)
