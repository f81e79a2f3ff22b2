"""Exports a node holds whole, by content id: found on disk, served to members, fetched from them.

An export (every stage's IR and manifest, ``export.json``, ``config.json`` and the tokenizer) is
named by its **content id**: the SHA-256 of its stages' manifest hashes (each manifest lists its
files' hashes), so the same export has the same id on every node that holds a copy, however it
got there. The coordinator exports once; every member that has the disk keeps a copy (fetched
from a peer over the node links, each file checked against its hash) in the same place of its
own exports folder. A newly elected coordinator then finds the running plan's export on its own
disk (no export again), and a node taking over a lost stage loads it from there (no download).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import aiohttp

from agent.common.hashing import sha256_file
from agent.common.paths import exports_dir
from agent.export.exporter import ExportResult, load_export

log = logging.getLogger(__name__)
INDEX = "held-index.json"  # per export folder: the content id and every file's size and hash (cached)
RESERVE_BYTES = 2 << 30  # a copy is kept only while this much disk stays free beside it
MAX_FILES = 4096
MAX_INDEX_BYTES = 4 << 20
FETCH_TIMEOUT_S = 30.0  # without progress


def content_id(manifest_sha256s: list[str]) -> str:
    """An export's id from its stages' manifest hashes, in stage order."""
    return hashlib.sha256("\n".join(manifest_sha256s).encode()).hexdigest()[:32]


def export_content_id(export: ExportResult) -> str:
    return content_id([sha256_file(d / "manifest.json") for d in export.stage_dirs()])


@dataclass(frozen=True)
class HeldFile:
    path: str  # relative to the export folder, with '/'
    size: int
    sha256: str


@dataclass(frozen=True)
class Held:
    id: str
    dir: Path
    rel: str  # the folder relative to the exports folder ("<model>-<sha>/<options>-<split>")
    files: tuple[HeldFile, ...]
    stage_manifests: tuple[str, ...]  # each stage's manifest sha256

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def index(self) -> dict[str, Any]:
        return {"id": self.id, "path": self.rel, "files": [[f.path, f.size, f.sha256] for f in self.files]}


def _index_folder(d: Path, root: Path) -> Held | None:
    """The content index of the complete export at ``d`` (computed once, then read from its cache file)."""
    exp = load_export(d)
    if exp is None:
        return None
    cache = d / INDEX
    stamp = (d / "export.json").stat().st_mtime_ns
    try:
        got = json.loads(cache.read_text())
        if got.get("stamp") == stamp:
            files = tuple(HeldFile(*f) for f in got["files"])
            return Held(got["id"], d, d.relative_to(root).as_posix(), files, tuple(got["stages"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    stages = [sha256_file(s / "manifest.json") for s in exp.stage_dirs()]
    found = sorted(p for p in d.rglob("*") if p.is_file() and p.name != INDEX and not p.is_symlink())
    listed = [HeldFile(f.relative_to(d).as_posix(), f.stat().st_size, sha256_file(f)) for f in found]
    held = Held(content_id(stages), d, d.relative_to(root).as_posix(), tuple(listed), tuple(stages))
    body = {"stamp": stamp, "id": held.id, "stages": stages, "files": [[f.path, f.size, f.sha256] for f in listed]}
    with contextlib.suppress(OSError):  # a read-only cache: computed again next time
        cache.write_text(json.dumps(body))
    return held


class HeldExports:
    """The complete exports in this node's exports folder (rescanned at most every ``every_s``)."""

    def __init__(self, root: Path | None = None, every_s: float = 2.0) -> None:
        self._root = root
        self.every_s = every_s
        self._held: dict[str, Held] = {}
        self._scanned = float("-inf")

    @property
    def root(self) -> Path:
        return self._root or exports_dir()

    def scan(self, force: bool = False) -> dict[str, Held]:
        """Blocking (hashes new exports' files): call it off the event loop."""
        if not force and time.monotonic() - self._scanned < self.every_s:
            return self._held
        root = self.root
        found: dict[str, Held] = {}
        for meta in root.glob("*/*/export.json"):
            h = _index_folder(meta.parent, root)
            if h is not None:
                found[h.id] = h
        self._held, self._scanned = found, time.monotonic()
        return found

    def get(self, export_id: str) -> Held | None:
        return self._held.get(export_id)

    def ids(self) -> tuple[str, ...]:
        """Newest first (what beats announce)."""
        return tuple(sorted(self._held, key=lambda i: -self._held[i].dir.stat().st_mtime)) if self._held else ()

    def stage_dir(self, manifest_sha256: str) -> Path | None:
        """A held stage folder whose manifest has this hash (a stage assigned here needs no download)."""
        for h in self._held.values():
            for i, m in enumerate(h.stage_manifests):
                if m == manifest_sha256:
                    return h.dir / f"stage_{i}"
        return None


class FetchError(RuntimeError):
    pass


def _safe_rel(path: str) -> PurePosixPath:
    p = PurePosixPath(path)
    if p.is_absolute() or not p.parts or any(part in ("", ".", "..") for part in p.parts) or "\\" in path:
        raise FetchError(f"refusing the path {path!r}")
    return p


def check_index(body: Any, export_id: str) -> tuple[str, list[HeldFile]]:
    """The folder and files of a peer's index, every field checked (a peer may be wrong or hostile)."""
    if not isinstance(body, dict) or body.get("id") != export_id:
        raise FetchError("the index is not for this export")
    rel, files = body.get("path"), body.get("files")
    if not isinstance(rel, str) or len(_safe_rel(rel).parts) != 2:
        raise FetchError("the index names no usable folder")
    if not isinstance(files, list) or not 0 < len(files) <= MAX_FILES:
        raise FetchError("the index lists no usable files")
    out = []
    for f in files:
        if not (isinstance(f, list) and len(f) == 3 and isinstance(f[0], str) and isinstance(f[2], str)):
            raise FetchError("a file entry of the index is malformed")
        if isinstance(f[1], bool) or not isinstance(f[1], int) or f[1] < 0:
            raise FetchError("a file entry of the index has no usable size")
        _safe_rel(f[0])
        out.append(HeldFile(f[0], f[1], f[2]))
    return rel, out


async def async_fetch(
    session: aiohttp.ClientSession, base: str, export_id: str, held: HeldExports, progress: dict[str, Any]
) -> Held:
    """Copy export ``export_id`` from the peer at ``base`` (its ``/v1/exports`` URL) into this node's
    exports folder; every file is checked against the index, and the index against the content id
    (the stages' manifests). ``progress`` is updated as it goes (shown in ``/v1/node``)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=FETCH_TIMEOUT_S)
    async with session.get(f"{base}/{export_id}", timeout=timeout) as r:
        if r.status != 200:
            raise FetchError(f"HTTP {r.status} for the index")
        body = await r.json(content_type=None)
    rel, files = check_index(body, export_id)
    root = held.root
    dest = root / rel
    total = sum(f.size for f in files)
    free = shutil.disk_usage(root).free
    if free < total + RESERVE_BYTES:
        raise FetchError(f"not enough disk for a copy ({total / 2**20:.0f} MB, {free / 2**30:.1f} GB free)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=dest.parent))
    progress.update(export=export_id, bytes=0, total=total)
    try:
        for f in files:
            target = tmp / _safe_rel(f.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            got = hashlib.sha256()
            n = 0
            async with session.get(f"{base}/{export_id}/f/{f.path}", timeout=timeout) as r:
                if r.status != 200:
                    raise FetchError(f"HTTP {r.status} for {f.path}")
                with target.open("wb") as out:
                    async for chunk in r.content.iter_chunked(1 << 20):
                        n += len(chunk)
                        if n > f.size:
                            raise FetchError(f"{f.path}: more than the {f.size} bytes listed")
                        got.update(chunk)
                        out.write(chunk)
                        progress["bytes"] += len(chunk)
            if n != f.size or got.hexdigest() != f.sha256:
                raise FetchError(f"{f.path}: size or sha256 does not match the index")
        exp = load_export(tmp)
        if exp is None:
            raise FetchError("the files are not a complete export")
        stages = [sha256_file(d / "manifest.json") for d in exp.stage_dirs()]
        if content_id(stages) != export_id:
            raise FetchError("the stages' manifests do not hash to the export id")
        if dest.exists():  # this node's own export of the same split (other timings, so another id)
            old = dest.parent / f".replaced-{export_id}"
            os.rename(dest, old)  # a stage compiled from it keeps its open files
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    got_held = await asyncio.to_thread(held.scan, True)
    h = got_held.get(export_id)
    if h is None:
        raise FetchError("the copy is not found where it was put")
    return h


# -- serving copies to members (the agent's public port) ------------------------------------------
def add_routes(app: Any, held: HeldExports, allowed: Any) -> None:
    """``GET /v1/exports/{id}`` (the index) and ``/v1/exports/{id}/f/{path}`` (a file it lists), for
    the requests ``allowed(request)`` admits (members: with TLS, the peer middleware has already
    checked the certificate)."""
    from aiohttp import web

    async def index(request: web.Request) -> web.StreamResponse:
        if not allowed(request):
            raise web.HTTPForbidden(reason="only members of this cluster may fetch exports")
        h = (await asyncio.to_thread(held.scan)).get(request.match_info["id"])
        if h is None:
            raise web.HTTPNotFound(reason="this node holds no such export")
        return web.json_response(h.index())

    async def file(request: web.Request) -> web.StreamResponse:
        if not allowed(request):
            raise web.HTTPForbidden(reason="only members of this cluster may fetch exports")
        h = held.get(request.match_info["id"])
        name = request.match_info["path"]
        if h is None or not any(f.path == name for f in h.files):
            raise web.HTTPNotFound(reason="this node holds no such file")
        return web.FileResponse(h.dir / name)

    app.router.add_get(r"/v1/exports/{id:[0-9a-f]{32}}", index)
    app.router.add_get(r"/v1/exports/{id:[0-9a-f]{32}}/f/{path:.+}", file)
