"""What every HTTP API of the agent shares: one JSON error shape (OpenAI's error object), the
middleware that gives every error that shape, and the guard of routes only local programs may use."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def api_error(
    status: int, message: str, code: str | None, kind: str = "server_error", param: str | None = None
) -> web.Response:
    """OpenAI's error object: ``param`` names the request field at fault (None: no one field)."""
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status)


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error is OpenAI's JSON error object, unknown routes and methods included."""
    try:
        response: web.StreamResponse = await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
        return api_error(e.status, f"{request.method} {request.path}: {e.reason}", code or "error", kind)
    return response


Handler = Callable[[web.Request], Awaitable[web.Response]]


def local_only(handler: Handler) -> Handler:
    """Refuse what a browser could send: another Host (DNS rebinding), or any Origin."""

    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.Response:
        try:
            host = urlsplit("//" + (request.host or "")).hostname
        except ValueError:
            host = None
        if host not in LOCAL_HOSTS or "Origin" in request.headers:
            return api_error(403, "only local programs may use the cluster routes, not web pages", "forbidden")
        return await handler(request)

    return guarded
