"""The stage's work on its compute thread: the compiled stage, its streams and their steps.

Every method of :class:`StageWorker` that reads or changes its stage or streams runs on the
stage's compute thread (:mod:`agent.serving.compute`), one job at a time, in arrival order;
results go back to the event loop through the compute thread's hand-off
(``call_soon_threadsafe``). The event loop only reads its counters (for status) and the set of
recently closed streams, and sets three inputs, each a single reference the compute thread
reads once per job: ``paused`` (through :meth:`agent.serving.stage_host.StageHost.throttle`),
``loop_up`` (set by the websocket server) and the split-head rounds (:meth:`note_head_round`).
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np

from agent.protocol import Assign, Batch, Fwd, Head, HeadTop, Ids, Message, ProtocolError, TokenLogprobs, tensor
from agent.runtime.paged import PagedStage
from agent.runtime.sampling import Sampling, step_tokens
from agent.runtime.stage import Stage, StageError, StageOutput, Stream
from agent.serving.logprobs import step_logprobs
from agent.serving.paged_worker import BatchOut, PagedWorker

MAX_STREAMS = 256
HEAD_WINDOW = 8  # split-head rounds remembered to decide whether splitting pays
ROWS_SAMPLES = 8  # steps of one batch size before its median is reported
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


def finish(
    fwd: Fwd, toks: tuple[int, ...], busy_ms: float, logprobs: tuple[TokenLogprobs, ...] | None = None
) -> Output:
    """The last stage's answer to ``fwd`` once its tokens are chosen (with their log-probabilities,
    when asked), and the ring's next step. Touches no state: the event loop calls it too, once a
    split head's two parts are combined."""
    ids = Ids(
        term=fwd.term,
        stream=fwd.stream,
        seq=fwd.seq,
        tokens=toks,
        sent_at=fwd.sent_at,
        busy_ms=busy_ms,
        logprobs=logprobs,
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


class StageWorker:
    """The assigned stage and its streams, used only on the compute thread (see the module)."""

    def __init__(self, head_help: str = "auto") -> None:
        self.head_help = head_help  # whether a last stage may ask stage 0 for part of the head
        self.loop_up: Callable[[], bool] = lambda: False  # whether the link back to stage 0 is up (set by the server)
        self.paused: str | None = None  # why this node computes nothing now (its user, heat ...)
        self.head_steps = 0  # steps whose head was computed in two parts
        self.head_rounds: collections.deque[tuple[float, float]] = collections.deque(maxlen=HEAD_WINDOW)
        self._head_skipped = 0
        self.assignment: Assign | None = None
        self.stage: Stage | PagedStage | None = None
        self.paged: PagedWorker | None = None  # a paged stage's streams and steps
        self.streams: dict[str, Stream] = {}  # a stateful stage's
        self._free: list[Stream] = []
        self.closed: collections.OrderedDict[str, None] = collections.OrderedDict()  # recently closed streams
        self.frames = 0
        self.positions = 0  # positions computed (prompt and generated tokens)
        self.last_step_at: float | None = None  # wall clock of its last computed step
        self.compute_s = 0.0  # time spent in inference
        self.recent_ms: collections.deque[float] = collections.deque(maxlen=256)
        self.rows_ms: dict[int, collections.deque[float]] = {}  # a paged stage's step times by batch size

    def install(self, stage: Stage | PagedStage, msg: Assign) -> None:
        """Serve ``stage`` from now on (between two frames: none sees half a swap); streams are dropped."""
        if self.paged is not None:
            self.paged.close_all()  # (the same stage may be kept: its blocks go back)
        if stage is not self.stage:
            self.rows_ms.clear()  # another stage, other costs
        self.stage, self.assignment = stage, msg
        self.paged = PagedWorker(stage, MAX_STREAMS) if isinstance(stage, PagedStage) else None
        self.streams.clear()
        self._free.clear()

    @property
    def stream_count(self) -> int:
        return len(self.paged) if self.paged is not None else len(self.streams)

    def check_term(self, term: int) -> None:
        a = self.assignment
        if a is None:
            raise ProtocolError("not_assigned", "this agent serves no stage yet")
        if term != a.term:
            code = "stale_term" if term < a.term else "unknown_term"
            raise ProtocolError(code, f"frame of term {term}, stage assigned in term {a.term}")

    # -- micro-batches (a paged stage) -------------------------------------------------------------
    def process_batch(self, msg: Batch, payload: memoryview, keep: list[int]) -> BatchOut:
        """Run the parts ``keep`` of a Batch as one step (see :mod:`agent.serving.paged_worker`).
        What fails the whole frame (a paused node, a new assignment since it came) fails each part."""
        a = self.assignment
        try:
            if self.paused is not None:
                raise ProtocolError("paused", f"this node is paused ({self.paused})")
            self.check_term(msg.term)
            if self.paged is None or a is None:
                raise ProtocolError(
                    "unexpected", "this stage runs stateful attention: it takes Fwd frames, not batches"
                )
        except ProtocolError as e:
            failed = [ProtocolError(e.code, str(e), msg.parts[i].stream, msg.parts[i].seq) for i in keep]
            return BatchOut(frame=None, failed=failed)
        for i in keep:
            if msg.parts[i].start:
                self.closed.pop(msg.parts[i].stream, None)
        out = self.paged.batch(msg, payload, keep, a.wire_dtype)
        if out.tokens:
            self.frames += 1
            self.positions += out.tokens
            self.last_step_at = time.time()
            self.compute_s += out.seconds
            self.recent_ms.append(out.seconds * 1000)
            bucket = 1 << (out.tokens.bit_length() - 1)  # 1, 2, 4, 8, ... rows (rounded down)
            self.rows_ms.setdefault(bucket, collections.deque(maxlen=64)).append(out.seconds * 1000)
        return out

    def step_ms_by_rows(self, least: int = ROWS_SAMPLES) -> dict[str, float]:
        """Median step time (ms) per batch size (powers of two, rounded down) with ``least``
        samples or more: what the coordinator's calibration fits a batch curve to."""
        return {str(b): round(statistics.median(d), 3) for b, d in sorted(self.rows_ms.items()) if len(d) >= least}

    # -- the split head ----------------------------------------------------------------------------
    def _split_head(self, fwd: Fwd) -> bool:
        """Whether this last stage's step leaves the first rows of the head to stage 0: a greedy
        one-token step of a stream that has the ring to itself (so stage 0 has nothing else to do:
        no stage it passed holds another stream), and that asks for no log-probabilities (they
        need the whole row of logits)."""
        stage = self.stage
        return (
            self.head_help != "off"
            and isinstance(stage, Stage)  # a paged last stage never splits
            and stage.last
            and stage.hidden_out
            and stage.head_rows is not None
            and stage.head_rows[0] > 0
            and fwd.n == 1
            and not fwd.ret_logits
            and fwd.logits in ((), (0,))
            and fwd.sampling.temperature == 0.0
            and fwd.sampling.logprobs is None
            and max(fwd.ring_streams, self.stream_count) == 1
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
        """A split step's outcome (on the event loop; a deque append, read by the compute thread
        as a copy): see :func:`head_split_pays`."""
        self.head_rounds.append((late_ms, gain_ms))

    # -- frames ------------------------------------------------------------------------------------
    def process(self, fwd: Fwd, payload: memoryview) -> Output | HeadWait:
        """Run one Fwd frame. Raises ProtocolError for bad input.
        A :class:`HeadWait` means the vocabulary head is still to be computed (in two parts)."""
        if self.paused is not None:  # its streams move to the other nodes (the coordinator replays them)
            raise ProtocolError("paused", f"this node is paused ({self.paused})", fwd.stream, fwd.seq)
        stage, a = self.stage, self.assignment
        try:
            # the term is checked again here: a new assignment may have replaced the stage
            # between the frame's arrival (checked on the event loop) and its turn on this thread
            self.check_term(fwd.term)
            assert stage is not None and a is not None
            out, dt, split, pos0 = self._forward(stage, fwd, payload)
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
            held = max(fwd.ring_streams, self.stream_count)
            nxt = replace(fwd, dtype=wire, busy_ms=busy_ms, ack=False, ring_streams=held)  # ack: heard at stage 0
            return Output(nxt, h.tobytes())
        if split:
            assert out.hidden is not None
            self.head_steps += 1
            return HeadWait(fwd, busy_ms, np.array(out.hidden[:, -1:], dtype=np.float32), trunk_ms=dt * 1000)
        return self._last(fwd, out, busy_ms, pos0)

    def _forward(
        self, stage: Stage | PagedStage, fwd: Fwd, payload: memoryview
    ) -> tuple[StageOutput, float, bool, int]:
        """The stage's layers over the frame's input: (output, seconds, head split, first position)."""
        if stage.first:
            if fwd.dtype not in ("i32", "i64"):
                raise ProtocolError("bad_dtype", f"stage 0 takes token ids (i32/i64), not {fwd.dtype}")
            x = tensor(fwd, payload, 0).astype(np.int64)
        else:
            if fwd.dtype not in ("f16", "f32"):
                raise ProtocolError("bad_dtype", f"stage {stage.index} takes hidden states (f16/f32), not {fwd.dtype}")
            x = tensor(fwd, payload, stage.hidden_size).astype(np.float32)
        if self.paged is not None:
            if fwd.start:
                self.closed.pop(fwd.stream, None)
            t0 = time.perf_counter()
            try:
                out, pos0 = self.paged.forward(fwd, x)
            except RuntimeError as e:  # OpenVINO rejected the input
                raise StageError(f"inference failed: {e}") from e
            dt = time.perf_counter() - t0
            self.compute_s += dt
            self.recent_ms.append(dt * 1000)
            return out, dt, False, pos0
        assert isinstance(stage, Stage)
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
        return out, dt, split, pos0

    def _last(self, fwd: Fwd, out: StageOutput, busy_ms: float, pos0: int) -> Output:
        """The last stage's answer: its logits (``ret_logits``), or the tokens it chose."""
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
        rows = list(fwd.logits) if fwd.logits else [fwd.n - 1]
        sp = Sampling(s.temperature, s.top_p, s.seed)
        toks = step_tokens(out.token_ids, out.logits, sp, [pos0 + r for r in rows])
        return finish(fwd, toks, busy_ms, step_logprobs(out.logits, toks, s))

    def head_own_part(self, wait: HeadWait) -> None:
        """The last stage's rows of a split head. The step's time is noted as if this stage had
        computed the whole head (its part scaled up by rows), so that the split planned from
        measured step times does not change with how many streams run."""
        stage = self.stage
        assert isinstance(stage, Stage) and stage.head_rows is not None
        t0 = time.perf_counter()
        wait.top = stage.head_top(wait.hidden)
        dt = time.perf_counter() - t0
        self.compute_s += dt
        a, b = stage.head_rows
        self.recent_ms.append(wait.trunk_ms + dt * 1000 * stage.vocab_size / (b - a))
        wait.gain_ms = dt * 1000 * a / (b - a)  # stage 0's rows, had this stage computed them

    def head_part(self, msg: Head, payload: memoryview) -> HeadTop:
        """Stage 0's rows of the vocabulary head for a last stage's step."""
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

    # -- streams -----------------------------------------------------------------------------------
    def _stream(self, fwd: Fwd) -> Stream:
        st = self.streams.get(fwd.stream)
        if fwd.start:
            if st is None:
                if len(self.streams) >= MAX_STREAMS:
                    raise ProtocolError("too_many_streams", f"this stage holds {MAX_STREAMS} streams already")
                assert isinstance(self.stage, Stage)
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
        if self.paged is not None:
            self.paged.close(stream)
            return
        st = self.streams.pop(stream, None)
        if st is not None and len(self._free) < 8:
            self._free.append(st)  # keep a few requests for reuse (reset on the next start)
