"""A fake of what the tray talks to (the coordinator's chat API through the local agent), for GUI tests."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

ANSWER = ["The ", "capital ", "of ", "France ", "is ", "Paris."]


PARTIAL = "".join(ANSWER[:2])


FULL = "".join(ANSWER)


NOTE = "interrupted: retrying…"


class FakeCoordinator:
    """The coordinator's chat API as the tray sees it (models, and answers streamed as
    server-sent events), where each chat request plays the next of ``plays``:

    - ``full``: the whole answer, its finish chunk and ``[DONE]``;
    - ``cut``: two pieces, then the connection is aborted (aiohttp's ClientPayloadError);
    - ``eof``: two pieces, then the stream ends cleanly but without its end;
    - ``garbled``: two pieces, then an event that is not JSON;
    - ``error``: two pieces, then the coordinator's error event (a stage failed);
    - ``pause``: two pieces, an SSE comment and a status note (as the gateway sends while it
      finds a new coordinator), a pause until ``go_on`` is set, then the rest.

    The answer is :data:`ANSWER`, ended by ``stop``, unless ``replies`` holds the next one (its
    pieces and finish reason, e.g. ``length``); the end names ``nodes`` as the nodes that served.
    Each request's messages are kept in ``asked``, its whole body in ``bodies``. As the real API,
    it refuses ``continue_final_message`` (a 400 naming it) unless the last message is the
    assistant's.
    """

    def __init__(self) -> None:
        self.plays: list[str] = []
        self.asked: list[list[dict[str, str]]] = []
        self.bodies: list[dict[str, Any]] = []
        self.replies: list[tuple[list[str], str]] = []
        self.nodes: list[str] = ["n1"]
        self.go_on = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.asked.append(body["messages"])
        self.bodies.append(body)
        if body.get("continue_final_message") and body["messages"][-1]["role"] != "assistant":
            msg = "continue_final_message needs the last message to be the assistant's"
            err = {"message": msg, "type": "invalid_request_error", "param": "continue_final_message", "code": None}
            return web.json_response({"error": err}, status=400)
        play = self.plays.pop(0) if self.plays else "full"
        words, finish = self.replies.pop(0) if self.replies else (ANSWER, "stop")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def event(d: dict[str, Any]) -> None:
            await resp.write(f"data: {json.dumps(d)}\n\n".encode())

        async def piece(text: str, finish: str | None = None, **extra: Any) -> None:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
            await event({"object": "chat.completion.chunk", "choices": [choice], **extra})

        await piece("")  # the role chunk the coordinator sends first (no text)
        for w in words[:2]:
            await piece(w)
        if play == "cut":
            assert request.transport is not None
            request.transport.abort()
            return resp
        if play == "eof":
            await resp.write_eof()
            return resp
        if play == "garbled":
            await resp.write(b"data: {not json\n\n")
            return resp
        if play == "error":
            await event({"error": {"message": "generation failed: a stage died", "code": "stage_lost"}})
            return resp
        if play == "pause":
            await resp.write(b": the coordinator went away; finding another\n\n")
            await event({"lakeshard": {"status": NOTE}, "choices": [], "something_new": {"ok": 1}})
            await self.go_on.wait()
            await resp.write(b": still here\n\n")
            await asyncio.sleep(0.5)  # the scenario: half a second of silence, which must not end the answer
        for w in words[2:]:
            await piece(w)
        await piece("", finish, lakeshard={"nodes": list(self.nodes), "completion_tokens": len(words)})
        await resp.write(b"data: [DONE]\n\n")
        return resp
