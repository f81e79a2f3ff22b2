"""What an agent serves: one assigned stage, its streams, and the compute thread.

Network-free, so it can be driven by the websocket server or directly. All OpenVINO work
(compiling, inference) runs on one dedicated thread, never on the event loop; frames are
processed in arrival order, which keeps each stream's steps in order.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil

from agent.common.hashing import sha256_file
from agent.common.paths import cache_dir
from agent.export.held import HeldExports
from agent.protocol import Assign, Assigned, Fwd, Head, HeadTop, Ids, Message, ProtocolError, StageReport, tensor
from agent.protocol.control import EXPORT_RE
from agent.runtime.device import DeviceError, assigned_device, choose_device
from agent.runtime.sampling import Sampling, choose_token
from agent.runtime.stage import Stage, StageError, Stream
from agent.security import transport
from agent.serving.compute import ComputeThread

log = logging.getLogger(__name__)
MAX_STREAMS = 256
HEAD_WINDOW = 8  # split-head rounds remembered to decide whether splitting pays
HEAD_PROBE_EVERY = 32  # while it does not, one step in this many still splits, to re-measure


def head_split_pays(rounds: Iterable[tuple[float, float]]) -> bool:
    """Whether to split a lone stream's head, given recent split rounds as (``late_ms``: how long
    after its own part the last stage waited for stage 0's, ``gain_ms``: what stage 0's rows
    would have cost it). Split while there is no history; else when the typical wait is the
    smaller (a slow link to stage 0, or a busy stage 0, makes the wait the larger)."""
    seen = list(rounds)
    if not seen:
        return True
    return statistics.median(r[0] for r in seen) < statistics.median(r[1] for r in seen)


STAGE_FILES = ("model.xml", "model.bin")
MAX_MANIFEST = 1 << 20  # bytes of a stage's manifest.json
MAX_STAGE_FILE = 1 << 40  # bytes of one stage file (the manifest's own "size" is what is enforced)
OPTIONAL_FILES = ("head.xml", "head.bin")  # a part of the vocabulary head (manifest "head_part")


@dataclass
class Output:
    message: Message
    payload: bytes = b""
    follow: Fwd | None = None  # the last stage's next step for stage 0 (Fwd.auto)
    follow_payload: bytes = b""


@dataclass
class HeadWait:
    """A last stage's step whose layers are done, its head computed in two parts: ``hidden``
    goes to stage 0 for the first rows; ``top`` (set on the compute thread) is this stage's."""

    fwd: Fwd
    busy_ms: float
    hidden: np.ndarray  # float32 [1, 1, H]
    trunk_ms: float = 0.0  # the layers' time
    gain_ms: float = 0.0  # what stage 0's part saves this stage (its rows at this stage's speed)
    done_at: float = 0.0  # when this stage's own part was back on the event loop (monotonic)
    top: tuple[np.ndarray, np.ndarray] | None = None


class StageHost:
    def __init__(
        self, *, device: str = "AUTO", threads: int | None = None, spin_ms: float = 50.0, head_help: str = "auto"
    ) -> None:
        self.device = device
        self.threads = threads
        self.head_help = head_help  # whether a last stage may ask stage 0 for part of the head
        self.loop_up: Callable[[], bool] = lambda: False  # whether the link back to stage 0 is up (set by the server)
        self.head_steps = 0  # steps whose head was computed in two parts
        self.head_rounds: collections.deque[tuple[float, float]] = collections.deque(maxlen=HEAD_WINDOW)
        self._head_skipped = 0
        self.term_seen = 0
        self.assignment: Assign | None = None
        self.stage: Stage | None = None
        self.streams: dict[str, Stream] = {}
        self._free: list[Stream] = []
        self.closed: collections.OrderedDict[str, None] = collections.OrderedDict()  # recently closed streams
        self.compute = ComputeThread(spin_s=spin_ms / 1000.0)
        self.frames = 0
        self.positions = 0  # positions computed (prompt and generated tokens)
        self.next_rtt_ms: float | None = None  # round trip to the next agent of the ring (smoothed)
        self.paused: str | None = None  # why this node computes nothing now (its user, heat ...)
        self.last_step_at: float | None = None  # wall clock of its last computed step
        self.errors = 0
        self.compute_s = 0.0  # time spent in inference (on the compute thread)
        self.recent_ms: collections.deque[float] = collections.deque(maxlen=256)
        self.fetching: dict[str, Any] | None = None  # the stage file being downloaded, with progress
        self.preparing: str | None = None  # what an assignment does now: "fetching" or "compiling" its stage
        self.held: HeldExports | None = None  # exports this node holds whole: their stages need no download
        self.reused = 0  # assignments of the stage already compiled here (a new coordinator took over)

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
                stage_dir = await self._artifacts(msg)
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
        await self.compute.async_run(self._install, stage, msg)
        return Assigned(term=msg.term, stage=msg.stage, device=stage.device, compile_s=time.monotonic() - t0)

    def _same_stage(self, msg: Assign) -> Stage | None:
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
        return float("inf") if self.last_step_at is None else time.time() - self.last_step_at

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

    def _install(self, stage: Stage, msg: Assign) -> None:
        self.stage, self.assignment = stage, msg
        self.streams.clear()
        self._free.clear()

    def _compile(self, stage_dir: Path, exact: bool, device: str | None = None) -> Stage:
        return Stage(stage_dir, device=device or self.device, threads=self.threads, exact=exact)

    async def _artifacts(self, msg: Assign) -> Path:
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
            async with transport.current().session() as s:
                base = msg.artifacts_url.rstrip("/")
                (part / "manifest.json").unlink(missing_ok=True)
                await self._fetch(s, f"{base}/manifest.json", part / "manifest.json", msg.link_mbps, MAX_MANIFEST)
                if await asyncio.to_thread(sha256_file, part / "manifest.json") != msg.manifest_sha256:
                    raise ProtocolError("bad_artifact", "manifest hash does not match the assignment")
                manifest = json.loads((part / "manifest.json").read_text())
                names = [*STAGE_FILES, *(f for f in OPTIONAL_FILES if f in manifest["files"])]
                for name in names:
                    size = manifest["files"][name]["size"]
                    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_STAGE_FILE:
                        raise ProtocolError("bad_artifact", f"{name}: the manifest declares no usable size")
                    await self._fetch(s, f"{base}/{name}", part / name, msg.link_mbps, size)
                    if await asyncio.to_thread(sha256_file, part / name) != manifest["files"][name]["sha256"]:
                        (part / name).unlink()
                        raise ProtocolError("bad_artifact", f"{name}: sha256 does not match the manifest")
            if not dest.exists():
                part.rename(dest)
            return dest
        except (aiohttp.ClientError, OSError, KeyError, ValueError, TypeError) as e:
            raise ProtocolError("bad_artifact", f"cannot fetch the stage files from {msg.artifacts_url}: {e}") from e
        finally:
            self.fetching = None

    async def _fetch(self, s: aiohttp.ClientSession, url: str, path: Path, mbps: float, limit: int) -> None:
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

    # -- frames (compute thread) -----------------------------------------------------------
    def check_term(self, term: int) -> None:
        a = self.assignment
        if a is None:
            raise ProtocolError("not_assigned", "this agent serves no stage yet")
        if term != a.term:
            code = "stale_term" if term < a.term else "unknown_term"
            raise ProtocolError(code, f"frame of term {term}, stage assigned in term {a.term}")

    def _split_head(self, fwd: Fwd) -> bool:
        """Whether this last stage's step leaves the first rows of the head to stage 0: a greedy
        one-token step of a stream that has the ring to itself (so stage 0 has nothing else to do:
        no stage it passed holds another stream)."""
        stage = self.stage
        return (
            self.head_help != "off"
            and stage is not None
            and stage.last
            and stage.hidden_out
            and stage.head_rows is not None
            and stage.head_rows[0] > 0
            and fwd.n == 1
            and not fwd.ret_logits
            and fwd.logits in ((), (0,))
            and fwd.sampling.temperature == 0.0
            and max(fwd.ring_streams, len(self.streams)) == 1
            and self.loop_up()
            and (self.head_help == "on" or self._split_pays())
        )

    def _split_pays(self) -> bool:
        if head_split_pays(self.head_rounds):
            return True
        self._head_skipped += 1
        if self._head_skipped < HEAD_PROBE_EVERY:
            return False
        self._head_skipped = 0
        return True

    def note_head_round(self, late_ms: float, gain_ms: float) -> None:
        """A split step's outcome (on the event loop): see :func:`head_split_pays`."""
        self.head_rounds.append((late_ms, gain_ms))

    def process(self, fwd: Fwd, payload: memoryview) -> Output | HeadWait:
        """Run one Fwd frame (on the compute thread). Raises ProtocolError for bad input.
        A :class:`HeadWait` means the vocabulary head is still to be computed (in two parts)."""
        if self.paused is not None:  # its streams move to the other nodes (the coordinator replays them)
            raise ProtocolError("paused", f"this node is paused ({self.paused})", fwd.stream, fwd.seq)
        stage, a = self.stage, self.assignment
        try:
            # the term is checked again here: a new assignment may have replaced the stage
            # between the frame's arrival (checked on the event loop) and its turn on this thread
            self.check_term(fwd.term)
            assert stage is not None and a is not None
            if stage.first:
                if fwd.dtype not in ("i32", "i64"):
                    raise ProtocolError("bad_dtype", f"stage 0 takes token ids (i32/i64), not {fwd.dtype}")
                x = tensor(fwd, payload, 0).astype(np.int64)
            else:
                if fwd.dtype not in ("f16", "f32"):
                    raise ProtocolError(
                        "bad_dtype", f"stage {stage.index} takes hidden states (f16/f32), not {fwd.dtype}"
                    )
                x = tensor(fwd, payload, stage.hidden_size).astype(np.float32)
            st = self._stream(fwd)
            if fwd.rollback:
                st.rollback(fwd.rollback)
                st.maybe_compact()
            pos0 = st.pos
            split = self._split_head(fwd)
            idx = np.asarray(fwd.logits, dtype=np.int64) if fwd.logits else None
            if split:
                idx = np.zeros(0, dtype=np.int64)
            try:
                t0 = time.perf_counter()
                out = stage.forward(st, x, logits_idx=idx)
                dt = time.perf_counter() - t0
                self.compute_s += dt
                if not split:  # a split step's time is noted once its head part is done
                    self.recent_ms.append(dt * 1000)
            except StageError:
                raise
            except RuntimeError as e:  # OpenVINO rejected the input
                raise StageError(f"inference failed: {e}") from e
        except StageError as e:
            raise ProtocolError("bad_input", str(e), fwd.stream, fwd.seq) from None
        except ProtocolError as e:
            e.stream, e.seq = fwd.stream, fwd.seq
            raise
        self.frames += 1
        self.positions += fwd.n
        self.last_step_at = time.time()
        busy_ms = max(fwd.busy_ms, dt * 1000)  # the ring's bottleneck so far
        if not stage.last:
            assert out.hidden is not None
            wire = a.wire_dtype
            h = out.hidden.astype(np.float16) if wire == "f16" else out.hidden
            held = max(fwd.ring_streams, len(self.streams))
            nxt = replace(fwd, dtype=wire, busy_ms=busy_ms, ack=False, ring_streams=held)  # ack: heard at stage 0
            return Output(nxt, h.tobytes())
        if split:
            assert out.hidden is not None
            self.head_steps += 1
            return HeadWait(fwd, busy_ms, np.array(out.hidden[:, -1:], dtype=np.float32), trunk_ms=dt * 1000)
        assert out.token_ids is not None and out.logits is not None
        if fwd.ret_logits:
            lg = np.ascontiguousarray(out.logits, dtype=np.float32)
            msg = Ids(
                term=fwd.term,
                stream=fwd.stream,
                seq=fwd.seq,
                tokens=(),
                sent_at=fwd.sent_at,
                rows=lg.shape[0],
                vocab=lg.shape[1],
                busy_ms=busy_ms,
            )
            return Output(msg, lg.tobytes())
        s = fwd.sampling
        if s.temperature == 0.0:
            toks = tuple(int(t) for t in out.token_ids)
        else:
            sp = Sampling(s.temperature, s.top_p, s.seed)
            rows = list(fwd.logits) if fwd.logits else [fwd.n - 1]
            toks = tuple(choose_token(out.logits[k], sp, pos0 + rows[k]) for k in range(len(rows)))
        return self.finish(fwd, toks, busy_ms)

    def finish(self, fwd: Fwd, toks: tuple[int, ...], busy_ms: float) -> Output:
        """The last stage's answer to ``fwd`` once its tokens are chosen (and the ring's next step)."""
        ids = Ids(
            term=fwd.term,
            stream=fwd.stream,
            seq=fwd.seq,
            tokens=toks,
            sent_at=fwd.sent_at,
            busy_ms=busy_ms,
        )
        if fwd.auto > 0 and toks and toks[-1] not in fwd.stop:
            nxt = Fwd(
                term=fwd.term,
                stream=fwd.stream,
                seq=fwd.seq + 1,
                n=1,
                dtype="i32",
                sampling=fwd.sampling,
                sent_at=time.time(),
                auto=fwd.auto - 1,
                stop=fwd.stop,
            )
            return Output(ids, follow=nxt, follow_payload=np.asarray(toks[-1:], dtype=np.int32).tobytes())
        return Output(ids)

    def head_own_part(self, wait: HeadWait) -> None:
        """The last stage's rows of a split head (on the compute thread). The step's time is noted
        as if this stage had computed the whole head (its part scaled up by rows), so that the
        split planned from measured step times does not change with how many streams run."""
        stage = self.stage
        assert stage is not None and stage.head_rows is not None
        t0 = time.perf_counter()
        wait.top = stage.head_top(wait.hidden)
        dt = time.perf_counter() - t0
        self.compute_s += dt
        a, b = stage.head_rows
        self.recent_ms.append(wait.trunk_ms + dt * 1000 * stage.vocab_size / (b - a))
        wait.gain_ms = dt * 1000 * a / (b - a)  # stage 0's rows, had this stage computed them

    def head_part(self, msg: Head, payload: memoryview) -> HeadTop:
        """Stage 0's rows of the vocabulary head for a last stage's step (on the compute thread)."""
        stage = self.stage
        if self.paused is not None:
            raise ProtocolError("paused", f"this node is paused ({self.paused})", msg.stream, msg.seq)
        try:
            self.check_term(msg.term)  # the stage may have been re-assigned since the frame came
        except ProtocolError as e:
            e.stream, e.seq = msg.stream, msg.seq
            raise
        assert stage is not None
        if stage.head_rows is None or not stage.first:
            raise ProtocolError("no_head_part", "this stage holds no part of the vocabulary head", msg.stream, msg.seq)
        hidden = tensor(msg, payload, stage.hidden_size)
        try:
            values, ids = stage.head_top(hidden)
        except (StageError, RuntimeError) as e:
            raise ProtocolError("bad_input", str(e), msg.stream, msg.seq) from None
        return HeadTop(
            term=msg.term,
            stream=msg.stream,
            seq=msg.seq,
            values=tuple(float(v) for v in values),
            ids=tuple(int(i) for i in ids),
        )

    def _stream(self, fwd: Fwd) -> Stream:
        st = self.streams.get(fwd.stream)
        if fwd.start:
            if st is None:
                if len(self.streams) >= MAX_STREAMS:
                    raise ProtocolError("too_many_streams", f"this stage holds {MAX_STREAMS} streams already")
                assert self.stage is not None
                st = self._free.pop() if self._free else self.stage.open_stream()
                self.streams[fwd.stream] = st
                self.closed.pop(fwd.stream, None)
            st.reset()
            return st
        if st is None:
            raise ProtocolError("unknown_stream", f"unknown stream {fwd.stream!r} (start it with start=true)")
        return st

    def close_stream(self, stream: str) -> None:
        self.closed[stream] = None
        while len(self.closed) > 4096:
            self.closed.popitem(last=False)
        st = self.streams.pop(stream, None)
        if st is not None and len(self._free) < 8:
            self._free.append(st)  # keep a few requests for reuse (reset on the next start)

    def status(self) -> dict[str, Any]:
        a, s = self.assignment, self.stage
        return {
            "term_seen": self.term_seen,
            "assigned": a is not None,
            "stage": None if a is None else a.stage,
            "stages": None if a is None else a.stages,
            "layers": None if s is None else list(s.layers),
            "model": None if s is None else s.manifest.get("model", {}).get("name"),
            "model_layers": None if s is None else s.manifest.get("model", {}).get("layers"),
            "device": None if s is None else s.device,
            "streams": len(self.streams),
            "frames": self.frames,
            "head_steps": self.head_steps,
            "errors": self.errors,
            "compute_s": round(self.compute_s, 4),
            "step_ms_p50": round(statistics.median(self.recent_ms), 3) if self.recent_ms else None,
            "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
            "fetching": self.fetching,
            "preparing": self.preparing,
            "export": None if a is None else a.export_id,
            "term": None if a is None else a.term,
            "reused": self.reused,
            "next_rtt_ms": None if self.next_rtt_ms is None else round(self.next_rtt_ms, 3),
            "paused": self.paused,
            "last_step_at": self.last_step_at,
            "threads": self.threads,
        }

    def shutdown(self) -> None:
        self.compute.shutdown()
