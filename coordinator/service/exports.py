"""The coordinator's stage exports: export a plan's stages (or reuse an export already on disk),
and keep the table of exports the data listener serves to the agents.

One export runs at a time: a plan's and the failover's spare split share the export folders.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from agent.export.exporter import ExportProgress, ExportResult, cached_export, export_model
from agent.export.held import export_content_id

if TYPE_CHECKING:
    from coordinator.service.config import ServeConfig


class StageExports:
    """Exports made or reused for this coordinator's plans, by content id."""

    def __init__(self, cfg: ServeConfig) -> None:
        self._cfg = cfg  # (read at each export: the role may swap the model for one with weights, once pulled)
        self._served: dict[str, list[Path]] = {}  # export id -> stage folders (served to agents)
        self._lock = asyncio.Lock()
        self.current: ExportResult | None = None  # the running plan's export
        self.current_id: str | None = None  # its content id
        self.exported = 0  # exports its plans had to make (not found on disk; a spare split's not counted)

    def stage_dirs(self, export_id: str) -> list[Path] | None:
        """The stage folders served under ``export_id`` (None: none are)."""
        return self._served.get(export_id)

    async def async_export(self, ranges: list[tuple[int, int]], progress: ExportProgress | None) -> ExportResult:
        """Export (or reuse) a plan's stages: the running plan's export from now on."""
        cfg = self._cfg
        model, opts, quiet = cfg.model, cfg.opts, cfg.quiet
        loop = asyncio.get_running_loop()
        async with self._lock:
            if cached_export(model, ranges, opts) is None:
                self.exported += 1  # (a copy of the export on this disk is used as it is)
            export = await loop.run_in_executor(
                None, lambda: export_model(model, ranges, opts, quiet=quiet, progress=progress)
            )
        self.current = export
        return export

    async def async_serve(self, export: ExportResult) -> str:
        """Serve ``export``'s stages to the agents: its content id (the running plan's from now on)."""
        export_id = await asyncio.get_running_loop().run_in_executor(None, export_content_id, export)
        self._served[export_id] = export.stage_dirs()
        self.current_id = export_id
        return export_id

    async def async_spare(self, ranges: list[tuple[int, int]]) -> str:
        """Export a split ahead of need (quietly, not served until a plan uses it): its content id."""
        model, opts = self._cfg.model, self._cfg.opts
        loop = asyncio.get_running_loop()
        async with self._lock:
            done = await loop.run_in_executor(None, lambda: export_model(model, ranges, opts, quiet=True))
        return await loop.run_in_executor(None, export_content_id, done)
