"""Model pulls the local API runs for the tray: Settings' "Pull another…", with progress.

On the local API (127.0.0.1, local programs only):

* ``POST /v1/models/pull`` ``{"model": "qwen2.5-coder-0.5b"}``: start pulling a registry model into
  this laptop's store (202 with the pull's state; 200 when it is already pulled; a pull of the same
  model already under way is answered with its state, not started twice). An unknown name is a
  400 ``unknown_model`` naming the known ones.
* ``GET /v1/models/pulls``: every pull this agent ran or runs, newest first: ``model``, ``state``
  (``pulling``, ``done``, ``failed``), ``percent``, ``step`` (what it does now: "downloaded 45 MB
  of 491 MB"), ``error`` (the store's one-line reason) and ``started``/``finished`` (Unix time).

A pull runs on a thread of its own (pip and hashing are slow, never on the event loop) and
reports through the loop (``call_soon_threadsafe``), so the state is only touched there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from aiohttp import web

from agent.common.http import api_error, local_only

log = logging.getLogger(__name__)

PULLING, DONE, FAILED = "pulling", "done", "failed"


@dataclass(frozen=True)
class Pull:
    model: str
    state: str
    percent: float | None
    step: str
    started: float
    finished: float | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if self.percent is not None:
            d["percent"] = round(self.percent, 1)
        return d


# what runs a pull: (model name, progress reporter) -> None, raising with a one-line reason
Puller = Callable[[str, Callable[[float | None, str], None]], None]


def _store_pull(name: str, progress: Callable[[float | None, str], None]) -> None:
    from agent.models.store import ModelStore

    ModelStore().pull(name, quiet=True, progress=progress)


class Pulls:
    """The pulls of one agent. Loop-only methods are ``async_``-prefixed or called on the loop."""

    def __init__(self, puller: Puller = _store_pull) -> None:
        self._puller = puller
        self._pulls: dict[str, Pull] = {}

    def all(self) -> list[Pull]:
        return sorted(self._pulls.values(), key=lambda p: p.started, reverse=True)

    def get(self, model: str) -> Pull | None:
        return self._pulls.get(model)

    def async_start(self, model: str) -> Pull:
        """Start pulling ``model`` (on the loop); the running pull of it, if there is one."""
        running = self._pulls.get(model)
        if running is not None and running.state == PULLING:
            return running
        loop = asyncio.get_running_loop()
        pull = Pull(model, PULLING, 0.0, "starting", time.time())
        self._pulls[model] = pull

        def update(**changes: Any) -> None:
            cur = self._pulls.get(model)
            if cur is not None and cur.started == pull.started and cur.state == PULLING:
                self._pulls[model] = replace(cur, **changes)

        def report(percent: float | None, what: str) -> None:  # on the pull's thread
            loop.call_soon_threadsafe(lambda: update(percent=percent, step=what))

        def work() -> None:
            try:
                self._puller(model, report)
            except Exception as e:  # the store's errors say why; anything else is a bug, logged
                if not isinstance(e, RuntimeError | OSError):
                    log.exception("pulling %s failed", model)
                why = str(e) or type(e).__name__
                changes: dict[str, Any] = {"state": FAILED, "error": why, "step": "failed", "finished": time.time()}
            else:
                changes = {"state": DONE, "percent": 100.0, "step": "in the store", "finished": time.time()}
                log.info("pulled %s into the store", model)
            with contextlib.suppress(RuntimeError):  # the loop closed: the agent is stopping
                loop.call_soon_threadsafe(lambda: update(**changes))

        threading.Thread(target=work, name=f"pull-{model}", daemon=True).start()
        log.info("pulling %s (asked on the local API)", model)
        return pull


PULLS: web.AppKey[Pulls] = web.AppKey("model_pulls")


def _known() -> tuple[list[str], set[str]]:
    """The registry's names and those already in the store (reads the store: off the loop)."""
    from agent.models.registry import REGISTRY
    from agent.models.store import readable_models

    return sorted(REGISTRY), set(readable_models())


async def _start(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    model = body.get("model") if isinstance(body, dict) else None
    registry, have = await asyncio.to_thread(_known)
    if not isinstance(model, str) or not model.strip():
        return api_error(400, f'give the model, like {{"model": "{registry[0]}"}}', "bad_request")
    model = model.strip()
    if model not in registry:
        return api_error(
            400,
            f"unknown model {model!r}: the models that can be pulled are {', '.join(registry)} "
            "(a local checkpoint is added with 'lakeshard models import PATH')",
            "unknown_model",
            "invalid_request_error",
        )
    pulls = request.app[PULLS]
    running = pulls.get(model)
    if model in have and (running is None or running.state != PULLING):
        now = time.time()
        return web.json_response(Pull(model, DONE, 100.0, "in the store", now, now).to_json())
    return web.json_response(pulls.async_start(model).to_json(), status=202)


async def _list(request: web.Request) -> web.Response:
    return web.json_response({"pulls": [p.to_json() for p in request.app[PULLS].all()]})


def add_pull_routes(app: web.Application, pulls: Pulls | None = None) -> Pulls:
    """``POST /v1/models/pull`` and ``GET /v1/models/pulls`` on the local API."""
    app[PULLS] = pulls or Pulls()
    app.router.add_post("/v1/models/pull", local_only(_start))
    app.router.add_get("/v1/models/pulls", local_only(_list))
    return app[PULLS]
