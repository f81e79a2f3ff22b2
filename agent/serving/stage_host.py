"""What an agent serves: one assigned stage, its streams, and the compute thread.

Network-free, so it can be driven by the websocket server or directly. :class:`StageHost` is
the event loop's side: assignments (the stage's files, compiling), the throttle's limits and
the status. The stage itself and its streams belong to a :class:`StageWorker`, used only on
the stage's one compute thread (all OpenVINO work runs there, never on the event loop);
frames are processed in arrival order, which keeps each stream's steps in order.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from agent.export.held import HeldExports
from agent.protocol import Assign, Assigned, ProtocolError, StageReport
from agent.protocol.control import EXPORT_RE
from agent.runtime.device import DeviceError, assigned_device, choose_device
from agent.runtime.kv_budget import KvBudgetError, kv_memory_override, kv_pool_bytes
from agent.runtime.paged import PagedStage, PagedUnavailable, attention_path
from agent.runtime.stage import Stage
from agent.security.transport import Transport
from agent.serving.compute import ComputeThread
from agent.serving.stage_files import OPTIONAL_FILES, STAGE_FILES, StageFiles
from agent.serving.stage_worker import StageWorker

__all__ = ["OPTIONAL_FILES", "STAGE_FILES", "StageHost"]  # (the file names: the coordinator's too)
log = logging.getLogger(__name__)
# A paged stage's token budget per step: a prefill frame of the coordinator (at most 1024
# tokens) fits beside the decode tokens of many streams. LAKESHARD_STEP_TOKENS changes it.
STEP_TOKENS = 2048


def _env_count(name: str, default: int | None, most: int) -> int | None:
    """A positive whole number from the environment (tests and benchmarks), else ``default``."""
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    if not v.isdigit() or not 1 <= int(v) <= most:
        raise SystemExit(f"lakeshard: error: {name} must be a whole number from 1 to {most}, not {v!r}")
    return int(v)


class StageHost:
    def __init__(
        self,
        *,
        transport: Transport,  # how its stage's files are fetched from the coordinator
        device: str = "AUTO",
        threads: int | None = None,
        spin_ms: float = 50.0,
        head_help: str = "auto",
        attention: str = "auto",
    ) -> None:
        """``attention``: how its stages attend, ``auto`` (paged where the device runs
        PagedAttention: CPU and GPU), ``paged`` or ``stateful``; a stage that cannot run paged runs stateful (logged,
        and said in the status). A paged stage's KV pool holds ``LAKESHARD_KV_BLOCKS`` blocks
        when set (tests), else ``LAKESHARD_KV_MEMORY`` MiB, else its share of the memory free
        when it is compiled (:mod:`agent.runtime.kv_budget`)."""
        if attention not in ("auto", "paged", "stateful"):
            raise ValueError(f"attention must be auto, paged or stateful, not {attention!r}")
        self.attention = attention
        self._fallbacks: dict[Path, str] = {}  # why a stage (by its folder) compiled stateful despite the setting
        self.kv_blocks = _env_count("LAKESHARD_KV_BLOCKS", None, 1 << 24)
        try:
            self.kv_memory = kv_memory_override()  # else a share of the memory free at compile time
        except KvBudgetError as e:
            raise SystemExit(f"lakeshard: error: {e}") from None
        self.step_tokens = _env_count("LAKESHARD_STEP_TOKENS", STEP_TOKENS, 1 << 20)
        self.device = device
        self.threads = threads  # the threads the next stage it compiles may use (the throttle lowers it)
        self._threads = threads  # as configured
        self._spin_s = spin_ms / 1000.0
        self.term_seen = 0
        self.worker = StageWorker(head_help)  # the stage and its streams: compute thread only
        self.compute = ComputeThread(spin_s=self._spin_s)
        self.files = StageFiles(transport=transport)
        self.next_rtt_ms: float | None = None  # round trip to the next agent of the ring (smoothed)
        self.errors = 0
        self.preparing: str | None = None  # what an assignment does now: "fetching" or "compiling" its stage
        self.reused = 0  # assignments of the stage already compiled here (a new coordinator took over)

    # -- what the worker holds, as the event loop sees it ------------------------------------
    @property
    def assignment(self) -> Assign | None:
        return self.worker.assignment

    @property
    def stage(self) -> Stage | PagedStage | None:
        return self.worker.stage

    @property
    def positions(self) -> int:
        """Positions computed (prompt and generated tokens)."""
        return self.worker.positions

    @property
    def held(self) -> HeldExports | None:
        """Exports this node holds whole: their stages need no download."""
        return self.files.held

    @held.setter
    def held(self, held: HeldExports | None) -> None:
        self.files.held = held

    @property
    def fetching(self) -> dict[str, Any] | None:
        """The stage file being downloaded, with progress."""
        return self.files.fetching

    # -- the throttle ------------------------------------------------------------------------
    def throttle(self, paused: str | None, share: float | None) -> None:
        """The node's contribution (:mod:`agent.throttle.controller`, on the event loop).
        ``paused``: why it computes nothing now (None: it computes); ``share``: the share of the
        time it may compute while limited (None: not limited). Limited, the compute thread rests
        in proportion to its work and no longer spins between steps, and the next stage it
        compiles uses that share of the threads. Each input is one reference the compute thread
        reads once per job, so a pause refuses every step that has not started yet."""
        self.worker.paused = paused
        if share is not None:
            self.compute.pace(share, 0.0)
            if self._threads or psutil.cpu_count():
                base = self._threads or psutil.cpu_count() or 1
                self.threads = max(1, int(base * share))  # the next stage it compiles
        else:
            self.compute.pace(1.0, self._spin_s)
            self.threads = self._threads

    # -- assignment --------------------------------------------------------------------------
    async def async_assign(self, msg: Assign) -> Assigned:
        if msg.term < self.term_seen:
            raise ProtocolError("stale_term", f"assignment of term {msg.term} refused: term {self.term_seen} seen")
        t0 = time.monotonic()
        try:  # the device first: a stage this agent cannot run is refused before any download
            device = assigned_device(self.device, msg.device)
            await self.compute.async_run(choose_device, device)
        except DeviceError as e:
            raise ProtocolError("bad_device", str(e)) from None
        stage = self._same_stage(msg)
        if stage is None:
            try:
                self.preparing = "fetching"
                stage_dir = await self.files.async_stage_dir(msg)
                self.preparing = "compiling"
                stage = await self.compute.async_run(self._compile, stage_dir, msg.exact, device)
            except DeviceError as e:
                raise ProtocolError("bad_device", str(e)) from None
            finally:
                self.preparing = None
        else:
            self.reused += 1
            log.info("stage %d of term %d: the same files as before, kept compiled", msg.stage, msg.term)
        if stage.index != msg.stage or stage.count != msg.stages:
            raise ProtocolError("bad_artifact", f"artifacts are stage {stage.index}/{stage.count}, not {msg.stage}")
        if msg.term < self.term_seen:  # a newer coordinator assigned meanwhile
            raise ProtocolError("stale_term", f"assignment of term {msg.term} refused: term {self.term_seen} seen")
        # only a good assignment moves the term on: a bad one leaves the agent as it was
        self.term_seen = msg.term
        # swapped on the compute thread, between two frames: none sees half a swap
        await self.compute.async_run(self.worker.install, stage, msg)
        done = Assigned(term=msg.term, stage=msg.stage, device=stage.device, compile_s=time.monotonic() - t0)
        if isinstance(stage, PagedStage):  # what the coordinator's micro-batches must fit
            done = replace(
                done,
                kv_blocks=stage.pool.num_blocks,
                block_tokens=stage.block_size,
                step_tokens=stage.max_step_tokens,
            )
        return done

    def _same_stage(self, msg: Assign) -> Stage | PagedStage | None:
        """The stage compiled here already, when ``msg`` assigns the same files the same way (a newly
        elected coordinator adopting the running plan): it is kept, only its streams are dropped."""
        a, s = self.assignment, self.stage
        if a is None or s is None or a.manifest_sha256 != msg.manifest_sha256 or a.exact != msg.exact:
            return None
        if (a.stage, a.stages) != (msg.stage, msg.stages) or msg.device not in (None, s.device):
            return None
        return s

    def warm(self, stage_dir: Path) -> float:
        """Compile the stage at ``stage_dir`` once and drop it (blocking: a worker thread, never the
        compute thread): OpenVINO's compiled-model cache then holds it, so that taking it over
        after a node's loss loads it instead of compiling. The same compile properties as an
        assignment here would use (device, threads, exactness). Seconds it took."""
        t0 = time.monotonic()
        exact = self.assignment.exact if self.assignment is not None else False
        stage = self._compile(stage_dir, exact, choose_device(assigned_device(self.device, None)))
        del stage
        return time.monotonic() - t0

    def idle_for(self) -> float:
        """Seconds since this stage last computed (forever: it never did)."""
        at = self.worker.last_step_at
        return float("inf") if at is None else time.time() - at

    def report(self) -> StageReport | None:
        """The stage served now, as beats report it."""
        a, s = self.assignment, self.stage
        if a is None or s is None:
            return None
        model = s.manifest.get("model", {}).get("name")
        if not isinstance(model, str) or not model or not EXPORT_RE.match(a.export_id):
            return None
        start, end = s.layers
        return StageReport(model[:128], a.export_id, a.stage, a.stages, start, end, a.term)

    def _compile(self, stage_dir: Path, exact: bool, device: str | None = None) -> Stage | PagedStage:
        """The stage compiled as the attention setting says (the one place that chooses): paged
        where it asks for paged and the stage compiles paged there, else stateful."""
        device = choose_device(device or self.device)
        if attention_path(device, override=self.attention) == "paged":
            try:
                stage = PagedStage(
                    stage_dir,
                    device=device,
                    threads=self.threads,
                    exact=exact,
                    num_blocks=self.kv_blocks,
                    kv_bytes=self._kv_bytes(stage_dir),
                    max_step_tokens=self.step_tokens,
                )
            except PagedUnavailable as e:
                if len(self._fallbacks) >= 16:
                    self._fallbacks.clear()
                self._fallbacks[Path(stage_dir)] = str(e)[:500]
                log.warning("paged attention unavailable, this stage runs stateful: %s", e)
            else:
                return stage
        return Stage(stage_dir, device=device, threads=self.threads, exact=exact)

    def _kv_bytes(self, stage_dir: Path) -> int:
        """The KV pool of a paged stage compiled now: a share of the memory free, less its weights."""
        weights = sum(f.stat().st_size for f in Path(stage_dir).glob("*.bin"))
        return kv_pool_bytes(int(psutil.virtual_memory().available), weights, self.kv_memory)

    def status(self) -> dict[str, Any]:
        w = self.worker
        a, s = w.assignment, w.stage
        return {
            "term_seen": self.term_seen,
            "assigned": a is not None,
            "stage": None if a is None else a.stage,
            "stages": None if a is None else a.stages,
            "layers": None if s is None else list(s.layers),
            "model": None if s is None else s.manifest.get("model", {}).get("name"),
            "model_layers": None if s is None else s.manifest.get("model", {}).get("layers"),
            "device": None if s is None else s.device,
            "streams": w.stream_count,
            "frames": w.frames,
            "head_steps": w.head_steps,
            "errors": self.errors,
            "compute_s": round(w.compute_s, 4),
            "step_ms_p50": round(statistics.median(w.recent_ms), 3) if w.recent_ms else None,
            "step_ms_by_rows": w.step_ms_by_rows() or None,  # a paged stage's, by batch size
            "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
            "fetching": self.fetching,
            "preparing": self.preparing,
            "export": None if a is None else a.export_id,
            "term": None if a is None else a.term,
            "reused": self.reused,
            "next_rtt_ms": None if self.next_rtt_ms is None else round(self.next_rtt_ms, 3),
            "paused": w.paused,
            "last_step_at": w.last_step_at,
            "threads": self.threads,
            **self._attention_status(s),
        }

    def _attention_status(self, s: Stage | PagedStage | None) -> dict[str, Any]:
        """How the stage attends and, paged, its KV block pool (the event loop reads the free
        count as one value while the compute thread may be changing it)."""
        out: dict[str, Any] = {"attention": None if s is None else "paged" if isinstance(s, PagedStage) else "stateful"}
        if isinstance(s, PagedStage):
            out.update(
                kv_blocks_total=s.pool.num_blocks,
                kv_blocks_free=s.pool.free_blocks,
                kv_block_tokens=s.block_size,
                kv_pool_mb=round(s.pool.num_blocks * s.block_bytes / 2**20, 1),
                kv_precision=s.kv_precision,
            )
        why = None if s is None or isinstance(s, PagedStage) else self._fallbacks.get(s.dir)
        if why:
            out["attention_fallback"] = why
        return out

    def attention_fallback(self, stage_dir: Path) -> str | None:
        """Why the stage at ``stage_dir`` runs stateful though the setting asked for paged (None: it does not)."""
        return self._fallbacks.get(Path(stage_dir))

    def shutdown(self) -> None:
        self.compute.shutdown()
