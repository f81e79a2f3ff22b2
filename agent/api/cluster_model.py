"""The model the cluster serves, on the agent's APIs.

On the local API (127.0.0.1; local programs only, like :mod:`agent.security.local_routes`):

* ``GET /v1/cluster/model``: the cluster setting (``cluster``: version, model, weights, draft,
  who set it and when; null when none), this laptop's override (``override``: ``serve.model``
  in config.yaml or ``--serve-model``; null when none), what this node would serve if elected
  and why (``effective``), and the models on offer (``models``: the registry's, pulled or not,
  and this node's store's, each with ``pulled``), with the weight formats (``weights``);
* ``PUT /v1/cluster/model`` ``{"model": "smollm2-135m", "weights": "int8", "draft": null}``:
  set it for the whole cluster. The model must be a registry name or a model in this node's
  store (else 400 ``unknown_model`` naming the known ones), the weights one of the export's
  formats, the draft a known model, ``lookup`` or ``NAME+lookup``. The answer is the GET's,
  with a one-line ``message``.

On the data port (members only: a node certificate in a secured cluster), ``GET
/v1/cluster/settings``: the document this node holds, which peers fetch when its beats announce
a newer one (:mod:`agent.cluster.settings_gossip`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from agent.cluster.settings import LOOKUP, SettingsError, check_draft, check_model, check_weights, draft_model
from agent.cluster.settings_gossip import CHOOSE_HINT, Effective, SettingsGossip
from agent.common.config import WEIGHTS
from agent.common.http import api_error, local_only

log = logging.getLogger(__name__)


class ModelDoor(Protocol):
    """What the routes need of the agent."""

    def model_settings(self) -> SettingsGossip | None: ...  # None: not in a cluster yet

    def effective_model(self) -> Effective: ...

    def serve_override(self) -> tuple[str | None, str | None]: ...  # serve.model and serve.weights

    def display_name(self) -> str: ...  # what node maps call this laptop


DOOR: web.AppKey[ModelDoor] = web.AppKey("model_door")
HOLDER: web.AppKey[SettingsGossip] = web.AppKey("settings_holder")


def offered_models() -> list[dict[str, Any]]:
    """The registry's models (pulled or not), then the store's others, each marked ``pulled``
    (reads the store: call it off the event loop)."""
    from agent.models.registry import REGISTRY
    from agent.models.store import readable_models

    local = readable_models()
    out = [
        {
            "name": s.name,
            "description": s.description,
            "pulled": s.name in local,
            "default_weights": s.default_weights,
            "size": s.size,
            "source": "registry",
        }
        for s in REGISTRY.values()
    ]
    for name, m in sorted(local.items()):
        if name not in REGISTRY:
            out.append(
                {
                    "name": name,
                    "description": f"{m.model_type}, {m.num_layers} layers ({m.source})",
                    "pulled": True,
                    "default_weights": None,
                    "size": None,
                    "source": "store",
                }
            )
    return out


def check_override(ref: str) -> str | None:
    """Why ``serve.model`` = ``ref`` cannot be served (None: it can): a registry name, a model in
    the store, or a path to a GGUF file or Hugging Face directory (reads the store: off the loop)."""
    if Path(ref).expanduser().exists():
        return None
    known = [m["name"] for m in offered_models()]
    if ref in known:
        return None
    names = ", ".join(known)
    return f"serve.model: unknown model {ref!r}: use one of {names}, or a path to a .gguf file or a HF directory"


def _unknown(what: str, name: str, known: list[str]) -> SettingsError:
    return SettingsError(
        f"unknown {what} {name!r}: choose one of {', '.join(known)} (or add one with 'lakeshard models pull NAME' "
        "or 'lakeshard models import PATH')"
    )


def validate(body: Any, models: list[dict[str, Any]]) -> tuple[str, str | None, str | None]:
    """``(model, weights, draft)`` from a PUT body, checked against the models on offer."""
    if not isinstance(body, dict):
        raise SettingsError('the body must be a JSON object like {"model": "smollm2-135m"}')
    unknown = set(body) - {"model", "weights", "draft"}
    if unknown:
        raise SettingsError(f"unknown field(s): {', '.join(sorted(map(str, unknown)))} (model, weights, draft)")
    known = [m["name"] for m in models]
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise SettingsError(f"give the model: one of {', '.join(known)}")
    model = model.strip()
    if model not in known:
        raise _unknown("model", model, known)
    weights = body.get("weights") or None
    if weights is not None and weights not in WEIGHTS:
        raise SettingsError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    draft = body.get("draft") or None
    if draft is not None:
        if not isinstance(draft, str):
            raise SettingsError(f"draft must be a model name, {LOOKUP!r} or NAME+lookup")
        draft = draft.strip()
        named = draft_model(check_draft(draft))
        if named is not None and named not in known:
            raise _unknown("draft", named, known)
    return check_model(model), check_weights(weights), draft


async def _answer(door: ModelDoor, holder: SettingsGossip) -> dict[str, Any]:
    model, weights = door.serve_override()
    doc = holder.held
    return {
        "cluster": None if doc is None else {**doc.fields(), "label": doc.label()},
        "override": None if not model else {"model": model, "weights": weights},
        "effective": door.effective_model().to_json(),
        "models": await asyncio.to_thread(offered_models),
        "weights": list(WEIGHTS),
    }


def _not_in_cluster() -> web.Response:
    return api_error(
        409,
        "this laptop is in no cluster yet: create or join one first, then choose the cluster's model",
        "not_in_cluster",
        "invalid_request_error",
    )


async def _get(request: web.Request) -> web.Response:
    door = request.app[DOOR]
    holder = door.model_settings()
    if holder is None:
        return _not_in_cluster()
    return web.json_response(await _answer(door, holder))


async def _put(request: web.Request) -> web.Response:
    door = request.app[DOOR]
    holder = door.model_settings()
    if holder is None:
        return _not_in_cluster()
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    models = await asyncio.to_thread(offered_models)
    try:
        model, weights, draft = validate(body, models)
        doc = await holder.async_set(model, weights, draft, door.display_name())
    except SettingsError as e:
        code = "unknown_model" if str(e).startswith("unknown") else "bad_setting"
        return api_error(400, str(e), code, "invalid_request_error")
    except OSError as e:
        return api_error(500, f"cannot write the cluster settings: {e}", "write_failed")
    answer = await _answer(door, holder)
    msg = f"{doc.label()}: the cluster serves {model}" + (f" ({weights})" if weights else "")
    eff = door.effective_model()
    if eff.override:
        msg += f"; this laptop overrides it with {eff.model} (serve.model in config.yaml) when it coordinates"
    answer["message"] = msg
    return web.json_response(answer)


async def _held(request: web.Request) -> web.Response:
    doc = request.app[HOLDER].held
    if doc is None:
        return api_error(404, f"this node holds no cluster settings: {CHOOSE_HINT}", "no_cluster_settings")
    return web.json_response(doc.to_json())


def add_model_routes(app: web.Application, door: ModelDoor) -> None:
    """``GET``/``PUT /v1/cluster/model`` on the local API."""
    app[DOOR] = door
    app.router.add_get("/v1/cluster/model", local_only(_get))
    app.router.add_put("/v1/cluster/model", local_only(_put))


def add_settings_route(app: web.Application, holder: SettingsGossip) -> None:
    """``GET /v1/cluster/settings`` on the data port (what peers fetch)."""
    app[HOLDER] = holder
    app.router.add_get("/v1/cluster/settings", _held)
