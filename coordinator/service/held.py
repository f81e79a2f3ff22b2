"""The exports this node holds, as the elected coordinator plans with them: which splits of a
model are at hand (an export at hand beats a marginally faster split), and the folder of an
export to take over (held here, or copied from a node that holds it)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp

from agent.export.held import FetchError, HeldExports, async_fetch
from agent.models.store import LocalModel, ModelStore
from agent.security.errors import SecurityError
from agent.security.transport import Transport
from coordinator.service.takeover import Held


async def copy_export(export: str, sources: list[str], tr: Transport) -> Path:
    """The folder of ``export`` on this node: held already, or copied from one of ``sources``
    (reached over ``tr``)."""
    held = HeldExports()
    h = (await asyncio.to_thread(held.scan, True)).get(export)
    if h is not None:
        return h.dir
    errors = []
    for src in sources:
        try:
            async with tr.session() as s:
                h = await async_fetch(s, tr.url(src, "/v1/exports"), export, held, {})
            return h.dir
        except (FetchError, aiohttp.ClientError, TimeoutError, SecurityError, ValueError) as e:
            errors.append(f"{src}: {e}")
    raise FetchError("; ".join(errors) or "no node holds it")


def held_metas(model: str, weights: str) -> list[tuple[str, dict[str, Any]]]:
    """The complete exports of ``model`` with ``weights`` on this node's disk: (id, export.json)."""
    out = []
    for h in HeldExports().scan(True).values():
        try:
            meta = json.loads((h.dir / "export.json").read_text())
        except (OSError, ValueError):
            continue
        if meta.get("model", {}).get("name") == model and meta.get("options", {}).get("weights") == weights:
            out.append((h.id, meta))
    return out


def held_exports(model: str, weights: str) -> list[Held]:
    return [Held(i, int(meta["stages"])) for i, meta in held_metas(model, weights)]


def held_splits(model: str, weights: str) -> list[list[tuple[int, int]]]:
    return [[(int(a), int(b)) for a, b in meta["ranges"]] for _, meta in held_metas(model, weights)]


def model_for(d: Path, meta: dict[str, Any]) -> LocalModel:
    """The store's model of this export when this node has it, else the model as the export
    describes it (config, tokenizer: enough to serve the export, not to export it again)."""
    info = meta["model"]
    have = ModelStore().get(info["name"])
    if have is not None and have.sha256 == info["sha256"]:
        return have
    return LocalModel.from_export(d)
