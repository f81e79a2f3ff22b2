"""An assigned stage's files: found on this disk, or downloaded from the coordinator and verified.

Runs on the event loop (hashing on worker threads); the download's progress is in ``fetching``
for the node's status.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from agent.common.hashing import sha256_file
from agent.common.paths import cache_dir
from agent.export.held import HeldExports
from agent.protocol import Assign, ProtocolError
from agent.security.transport import Transport

STAGE_FILES = ("model.xml", "model.bin")
MAX_MANIFEST = 1 << 20  # bytes of a stage's manifest.json
MAX_STAGE_FILE = 1 << 40  # bytes of one stage file (the manifest's own "size" is what is enforced)
OPTIONAL_FILES = ("head.xml", "head.bin")  # a part of the vocabulary head (manifest "head_part")


class StageFiles:
    def __init__(self, *, transport: Transport) -> None:
        self.transport = transport  # how the coordinator's artifact port is reached
        self.fetching: dict[str, Any] | None = None  # the stage file being downloaded, with progress
        self.held: HeldExports | None = None  # exports this node holds whole: their stages need no download

    async def async_stage_dir(self, msg: Assign) -> Path:
        """The stage's files: shared on disk if they match, else fetched over HTTP and verified."""
        if msg.local_dir:
            d = Path(msg.local_dir)
            man = d / "manifest.json"
            if man.is_file() and sha256_file(man) == msg.manifest_sha256:
                return d
        dest = cache_dir() / "artifacts" / msg.manifest_sha256[:32]
        if (dest / "manifest.json").is_file():
            return dest
        if self.held is not None:  # a copy of the whole export is here: no download
            here = self.held.stage_dir(msg.manifest_sha256)
            if here is not None and await asyncio.to_thread(sha256_file, here / "manifest.json") == msg.manifest_sha256:
                return here
        dest.parent.mkdir(parents=True, exist_ok=True)
        # a fetch cut short (agent restarted, link lost) resumes from what is already here
        part = dest.parent / f".partial-{msg.manifest_sha256[:32]}"
        part.mkdir(exist_ok=True)
        try:
            async with self.transport.session() as s:
                await self._fetch_all(s, msg, part)
            if not dest.exists():
                part.rename(dest)
            return dest
        except (aiohttp.ClientError, OSError, KeyError, ValueError, TypeError) as e:
            raise ProtocolError("bad_artifact", f"cannot fetch the stage files from {msg.artifacts_url}: {e}") from e
        finally:
            self.fetching = None

    async def _fetch_all(self, s: aiohttp.ClientSession, msg: Assign, part: Path) -> None:
        """The manifest (its hash the assignment's), then each file it names (their hashes its)."""
        base = msg.artifacts_url.rstrip("/")
        (part / "manifest.json").unlink(missing_ok=True)
        await self.async_fetch(s, f"{base}/manifest.json", part / "manifest.json", msg.link_mbps, MAX_MANIFEST)
        if await asyncio.to_thread(sha256_file, part / "manifest.json") != msg.manifest_sha256:
            raise ProtocolError("bad_artifact", "manifest hash does not match the assignment")
        manifest = json.loads((part / "manifest.json").read_text())
        names = [*STAGE_FILES, *(f for f in OPTIONAL_FILES if f in manifest["files"])]
        for name in names:
            size = manifest["files"][name]["size"]
            if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_STAGE_FILE:
                raise ProtocolError("bad_artifact", f"{name}: the manifest declares no usable size")
            await self.async_fetch(s, f"{base}/{name}", part / name, msg.link_mbps, size)
            if await asyncio.to_thread(sha256_file, part / name) != manifest["files"][name]["sha256"]:
                (part / name).unlink()
                raise ProtocolError("bad_artifact", f"{name}: sha256 does not match the manifest")

    async def async_fetch(self, s: aiohttp.ClientSession, url: str, path: Path, mbps: float, limit: int) -> None:
        """GET ``url`` into ``path``, resuming a partial file with a Range request; progress in status.
        ``mbps``: the emulated line rate (WAN mode), which the download keeps to; ``limit``: the
        most bytes the file may have (a server that sends more is refused, the file removed)."""
        have = path.stat().st_size if path.exists() else 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        async with s.get(url, headers=headers) as r:
            if r.status == 416:  # nothing left to fetch: the file is whole (the hash decides)
                return
            if r.status not in (200, 206):
                raise ProtocolError("bad_artifact", f"GET {url}: HTTP {r.status}")
            if r.status == 200:
                have = 0
            total = have + (r.content_length or 0)
            self.fetching = {"file": path.name, "bytes": have, "total": total, "resumed_from": have}
            t0, got = time.monotonic(), 0
            with path.open("ab" if have else "wb") as f:
                async for chunk in r.content.iter_chunked(1 << 20):
                    if self.fetching["bytes"] + len(chunk) > limit:
                        f.close()
                        path.unlink(missing_ok=True)
                        raise ProtocolError("bad_artifact", f"GET {url}: more than the {limit} bytes expected")
                    f.write(chunk)
                    self.fetching["bytes"] += len(chunk)
                    got += len(chunk)
                    if mbps > 0:
                        await asyncio.sleep(max(0.0, t0 + got * 8 / (mbps * 1e6) - time.monotonic()))
