"""Every member keeps a copy of the cluster's running export, so that a coordinator's death never
means exporting again (see :mod:`agent.export.held` for how exports are named and checked).

Beats say which stage each node serves (with the export's content id) and which exports it holds
whole; the coordinator's beat lists first the exports the cluster needs (the running one and the
split for one node fewer, prepared in advance). Once a second this node looks at what runs in the
cluster; an export that runs there, or that the coordinator says is needed, and that it does not
hold is fetched from a peer that announces it (the coordinator first), one at a time, when the
disk has room for it (a failure backs off, doubling). What it holds, and the stage it serves, go
into its own beats. While the node is idle (no step for a few seconds, not paused) it also
compiles those exports' stages once, one a second at most, and drops them: OpenVINO's
compiled-model cache then holds them, so a stage that moves here in a takeover loads instead of
compiling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from agent.cluster.peers import LocalNode
from agent.export.held import FetchError, Held, HeldExports, async_fetch
from agent.protocol import Beat
from agent.security.errors import SecurityError
from agent.security.transport import Transport
from agent.serving.stage_host import StageHost

log = logging.getLogger(__name__)
EVERY_S = 1.0
BACKOFF_S = 5.0
BACKOFF_MAX_S = 600.0
WARM_IDLE_S = 5.0  # stages are compiled ahead only after this long without a step (not while serving)


@dataclass(frozen=True)
class HeardPeer:
    node: str
    address: str  # host:port of its agent
    beat: Beat


class ExportCopies:
    def __init__(
        self,
        held: HeldExports,
        me: LocalNode,
        host: StageHost,
        peers: Callable[[], list[HeardPeer]],  # live peers, the coordinator first
        needed: Callable[[], list[str]] = list,  # while this node coordinates: the cluster's exports
        *,
        transport: Transport,  # how peers' exports are fetched
    ) -> None:
        self.held, self.me, self.host, self.peers = held, me, host, peers
        self.transport = transport
        self.needed = needed
        # what the last coordinator heard said the cluster needs (kept after it dies: its successor
        # may refit the nodes left onto one of these, never onto an old export found on disk)
        self.cluster_needs: tuple[str, ...] = ()
        self.warmed: set[str] = set()  # stage manifests compiled ahead (OpenVINO's cache holds them)
        self.warm_failed: set[str] = set()
        self.fetched = 0
        self.progress: dict[str, Any] | None = None
        self.last_error: str | None = None
        self._retry: dict[str, tuple[float, float]] = {}  # export -> (not before, backoff)

    async def run(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                await self.async_step()
            await asyncio.sleep(EVERY_S)

    async def async_step(self) -> None:
        held = await asyncio.to_thread(self.held.scan)
        mine = [e for e in self.needed() if e in held]
        self.me.exports = tuple(dict.fromkeys([*mine, *self.held.ids()]))
        self.me.needed = len(mine)
        self.me.serving = self.host.report()
        peers = self.peers()
        running = [p.beat.serving.export for p in peers if p.beat.serving is not None]
        for p in peers:
            if p.beat.role == "coordinator" and p.beat.needed:
                self.cluster_needs = p.beat.exports[: p.beat.needed]
        if self.me.needed:
            self.cluster_needs = self.me.exports[: self.me.needed]
        running += self.cluster_needs
        if self.me.serving is not None:
            running.append(self.me.serving.export)
        now = time.monotonic()
        for export in dict.fromkeys(running):
            if export in held or self._retry.get(export, (0.0, 0.0))[0] > now:
                continue
            sources = [p for p in peers if export in p.beat.exports]
            if sources:
                await self._fetch(export, sources)
                return  # one at a time
        await self._warm([held[e] for e in dict.fromkeys(running) if e in held])

    async def _warm(self, exports: list[Held]) -> None:
        """Compile one stage of the cluster's exports ahead (the next step does the next), while
        this node is idle and not paused: a takeover then loads it from the compiled-model cache."""
        if self.me.state == "paused" or self.host.idle_for() < WARM_IDLE_S:
            return
        mine = self.host.assignment.manifest_sha256 if self.host.assignment is not None else None
        for h in exports:
            for i, sha in enumerate(h.stage_manifests):
                if sha == mine or sha in self.warmed or sha in self.warm_failed:
                    continue
                try:
                    took = await asyncio.to_thread(self.host.warm, h.dir / f"stage_{i}")
                except Exception as e:  # a stage this node cannot compile: it is not the one to take it
                    self.warm_failed.add(sha)
                    log.info("stage %d of export %s not compiled ahead: %s", i, h.id, e)
                    return
                self.warmed.add(sha)
                log.info("stage %d of export %s compiled ahead in %.1f s (for a takeover)", i, h.id, took)
                return

    async def _fetch(self, export: str, sources: list[HeardPeer]) -> None:
        tr = self.transport
        errors = []
        for src in sources:
            self.progress = {"from": src.node}
            try:
                async with tr.session() as s:
                    t0 = time.monotonic()
                    h = await async_fetch(s, tr.url(src.address, "/v1/exports"), export, self.held, self.progress)
            except (FetchError, aiohttp.ClientError, TimeoutError, SecurityError, ValueError) as e:
                errors.append(f"{src.node}: {e}")
                continue
            finally:
                self.progress = None
            self.fetched += 1
            self.last_error = None
            self._retry.pop(export, None)
            log.info(
                "holding a copy of export %s (%.0f MB from %s in %.1f s)",
                export,
                h.size / 2**20,
                src.node,
                time.monotonic() - t0,
            )
            return
        backoff = min(self._retry.get(export, (0.0, BACKOFF_S / 2))[1] * 2, BACKOFF_MAX_S)
        self._retry[export] = (time.monotonic() + backoff, backoff)
        self.last_error = "; ".join(errors)
        log.warning("no copy of export %s yet (next try in %.0f s): %s", export, backoff, self.last_error)

    def status(self) -> dict[str, Any]:
        return {
            "held": list(self.me.exports),
            "fetching": self.progress,
            "fetched": self.fetched,
            "compiled_ahead": len(self.warmed),
            "last_error": self.last_error,
        }
