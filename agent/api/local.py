"""The agent's local API on 127.0.0.1: everything the tray and ``lakeshard status`` use.

* ``GET /v1/node``: this node (state and why, stage, memory, figures);
* ``GET /v1/cluster``: the election's view (peers, coordinator, term) and the coordinator's
  services when they run here;
* ``POST /v1/node/state``: ``{"state": "paused", "for_s": 3600}`` / ``{"state": "available"}``
  (the tray's pause switch; ``for_s`` resumes by itself);
* ``GET /v1/settings`` / ``PUT /v1/settings``: ``config.yaml``, read, and validated with the
  agent's own parser before it is written (``{"settings": {...}}`` or ``{"text": "..."}``; a
  new ``serve.model`` must name a model of the registry or the store, or an existing path);
  the election's, the name, the log level and the throttle apply at once, the rest is listed
  under ``restart``. The GET also says what the agent runs with (``effective``: every key, as
  a settings file would write it) beside what its file gives (``from_file``, the same shape;
  null when the file does not read), so that a reader can show which differ;
* ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/chat/completions``, ``POST
  /v1/completions``, ``GET /v1/cluster/events``: the coordinator's, wherever it runs
  (:mod:`agent.api.gateway`);
* ``GET`` / ``PUT /v1/cluster/model``: the model the cluster serves (:mod:`agent.api.cluster_model`);
* on ``lakeshard agent``, the cluster identity routes too (:mod:`agent.security.local_routes`).

It serves an :class:`agent.node.daemon.AgentDaemon`, or :class:`agent.node.unjoined.LocalAgent` (the same
answers, and ``no_cluster`` ones while this node waits for a cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from pathlib import Path
from typing import Any, Protocol

import yaml
from aiohttp import web

from agent.api.cluster_model import ModelDoor, add_model_routes, check_override
from agent.api.gateway import Door, Target, add_local_routes, describe
from agent.common.config import ConfigError, Settings, config_file, load, parse, to_mapping
from agent.common.http import api_error, json_errors
from agent.common.logs import set_file_level
from agent.common.paths import write_text_atomic
from agent.common.ports import listen_error
from agent.models.pulls import add_pull_routes
from agent.protocol.control import STATES

log = logging.getLogger(__name__)
MAX_BODY = 8 * 1024 * 1024  # chat requests pass through here (the coordinator's own limit)
MAX_PAUSE_S = 366 * 24 * 3600


class NotJoined(Exception):
    """This agent waits for a cluster: it has no state to switch (the message says what to do)."""


class Agent(Door, ModelDoor, Protocol):
    """What the local API needs of the agent."""

    config_path: Any

    def node_status(self) -> dict[str, Any]: ...

    def cluster_status(self) -> dict[str, Any]: ...

    def coordinator_target(self) -> Target | None: ...

    def set_state(self, state: str, for_s: float | None = None) -> None: ...

    def running_settings(self) -> Settings: ...

    def apply_settings(self, new: Settings, before: Settings | None = None) -> list[str]: ...


async def serve_local(runners: list[web.AppRunner], app: web.Application, port: int) -> int:
    """Serve the local API on 127.0.0.1:``port`` (0: any free port); the port it got."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    runners.append(runner)
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    except OSError as e:
        fix = "another agent may be running: give this one --api-port 0 (any free port) or another number"
        raise listen_error("the status API", "127.0.0.1", port, e, fix) from None
    return int(runner.addresses[-1][1])


def _bad(message: str) -> web.Response:
    return api_error(400, message, "bad_request", "invalid_request_error")


def make_local_app(daemon: Agent) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY, middlewares=[json_errors])
    app[DAEMON] = daemon
    app.router.add_get("/v1/node", _node)
    app.router.add_get("/v1/cluster", _cluster)
    app.router.add_post("/v1/node/state", _set_state)
    app.router.add_get("/v1/settings", _get_settings)
    app.router.add_put("/v1/settings", _put_settings)
    add_model_routes(app, daemon)
    add_pull_routes(app)
    add_local_routes(app, daemon)  # last: its /v1/models/{id} would take /v1/models/pulls
    return app


DAEMON: web.AppKey[Agent] = web.AppKey("daemon")


async def _node(request: web.Request) -> web.Response:
    return web.json_response(request.app[DAEMON].node_status())


async def _cluster(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    st = d.cluster_status()
    st["gateway"] = describe(d.coordinator_target())
    return web.json_response(st)


async def _set_state(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _bad('the body must be JSON like {"state": "paused"}')
    state = body.get("state") if isinstance(body, dict) else None
    if state not in STATES:
        return _bad(f"state must be one of {', '.join(STATES)}")
    for_s = body.get("for_s")
    if for_s is not None and (
        isinstance(for_s, bool)
        or not isinstance(for_s, int | float)
        or not math.isfinite(for_s)
        or not 0 < for_s <= MAX_PAUSE_S
    ):
        return _bad(f"for_s must be a number of seconds in (0, {MAX_PAUSE_S}]")
    try:
        d.set_state(state, for_s)
    except NotJoined as e:
        return api_error(409, str(e), "not_in_cluster", "invalid_request_error")
    return web.json_response(d.node_status())


def _settings_path(d: Agent) -> Path:
    return Path(d.config_path) if d.config_path else config_file()


async def _get_settings(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    path = _settings_path(d)
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    try:
        raw = yaml.safe_load(text) if text else {}
    except yaml.YAMLError:
        raw = None
    from_file: dict[str, Any] | None = None  # a broken file: nothing to compare with
    with contextlib.suppress(ConfigError):
        if raw is not None or not text:
            from_file = to_mapping(parse(raw or None))
    return web.json_response(
        {
            "file": str(path),
            "exists": path.is_file(),
            "text": text,
            "settings": raw if isinstance(raw, dict) else {},
            "effective": to_mapping(d.running_settings()),
            "from_file": from_file,
        }
    )


async def _put_settings(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _bad('the body must be JSON: {"settings": {...}} or {"text": "..."}')
    if not isinstance(body, dict) or ("settings" in body) == ("text" in body):
        return _bad('give either "settings" (a mapping) or "text" (the YAML file)')
    if "text" in body:
        if not isinstance(body["text"], str):
            return _bad("text must be a string")
        text = body["text"]
        try:
            data = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as e:
            return _bad(f"not valid YAML: {e}")
    else:
        data = body["settings"]
        if not isinstance(data, dict):
            return _bad("settings must be a mapping")
        text = yaml.safe_dump(data, sort_keys=False) if data else ""
    try:
        new = parse(data)
    except ConfigError as e:
        return _bad(str(e))
    path = _settings_path(d)
    try:
        before = load(path) if path.is_file() else None
    except ConfigError:
        before = None  # a broken file is being replaced
    if new.serve_model and new.serve_model != (before.serve_model if before else None):
        why = await asyncio.to_thread(check_override, new.serve_model)  # a name that exists, or a path
        if why is not None:
            return _bad(why)
    write_text_atomic(path, text)
    restart = d.apply_settings(new, before or Settings())
    set_file_level(new.log_level)
    log.info("settings written to %s%s", path, f"; restart needed for {', '.join(restart)}" if restart else "")
    return web.json_response({"ok": True, "file": str(path), "restart": restart})
