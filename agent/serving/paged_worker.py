"""A paged stage's streams and steps, on the compute thread (see :mod:`agent.serving.stage_worker`).

A paged stage (:class:`~agent.runtime.paged.PagedStage`) serves both frame kinds:

- a ``Fwd`` is a step of one part (:meth:`PagedWorker.forward`), so today's coordinator,
  speculation with rollback, seeded sampling, the ring loop and failover replay run on it as on
  a stateful stage (a paged last stage never splits its vocabulary head);
- a ``Batch`` is one infer call over all its parts (:meth:`PagedWorker.batch`). Each part is
  checked on its own; a part that cannot run fails alone (an error naming its stream) and the
  others go on: its rows do not fit the stage (``bad_input``), its stream is unknown, its
  rollback is longer than the stream, or the step has no room for it. No room is retryable and
  changes nothing for that part: ``over_budget`` (the step's token budget is spent by the
  parts before it) and ``no_blocks`` (the KV block pool cannot hold its new tokens; parts that
  need no new block, or that free some, always run, then the others in batch order while
  blocks last).

A starting part that names ``fork`` opens its stream on the named stream's first ``fork_len``
positions (prefix caching: those KV blocks are shared, not computed again) and its rows
continue at ``fork_len``. The source is taken as it stands after its own rollback in this
micro-batch and before any rows run; it must be a stream of this stage that does not start in
this micro-batch (``unknown_stream`` when there is none by that name, ``bad_input`` when it
starts here, or when ``fork_len`` is not a multiple of the block size or over its length). A
rollback that would end a stream inside a block another stream shares is ``bad_input`` too.

The next hop gets one ``Batch`` of the parts that ran (their hidden rows, in the wire's dtype);
a last stage answers one ``BatchIds`` with the tokens of every part that asked for some,
chosen exactly as the stateful path chooses them (argmax, or seeded sampling at the token's
position), and their log-probabilities for the parts whose sampling asks for them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from agent.protocol import Batch, BatchIds, Fwd, ProtocolError, TokenLogprobs, encode
from agent.protocol.batch import Part, batch_rows
from agent.runtime.blocks import PoolError, blocks_for
from agent.runtime.paged import Entry, PagedStage, PoolExhausted, StepResult
from agent.runtime.sampling import Sampling, step_tokens
from agent.runtime.stage import StageError, StageOutput
from agent.serving.logprobs import step_logprobs

RETRYABLE = frozenset({"no_blocks", "over_budget"})  # the part changed nothing: send it again later


@dataclass
class BatchOut:
    """A micro-batch's outcome on this stage: the frame for the next hop (None: no part ran)
    and an error for each part that did not run."""

    frame: bytes | None
    failed: list[ProtocolError] = field(default_factory=list)
    tokens: int = 0  # positions computed
    seconds: float = 0.0  # inference time


@dataclass
class _Cand:
    """A part that passed its own checks: its rows, and the stream's length it continues from."""

    part: Part
    x: np.ndarray
    base: int  # the stream's length after its start or rollback
    delta: int = 0  # blocks it takes from the pool (negative: it gives some back)


class PagedWorker:
    """The paged stage's streams by name (the pool numbers them) and its steps."""

    def __init__(self, stage: PagedStage, max_streams: int) -> None:
        self.stage = stage
        self.max_streams = max_streams
        self.ids: dict[str, int] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self.ids)

    # -- streams -----------------------------------------------------------------------------
    def _open(self, name: str, fork: tuple[int, int] | None = None) -> int:
        """A fresh stream called ``name`` (a running one of that name starts over); ``fork``:
        (source id, positions) it starts with, shared with that stream."""
        old = self.ids.pop(name, None)
        if old is not None:
            self.stage.close_stream(old)
        elif len(self.ids) >= self.max_streams:
            raise ProtocolError("too_many_streams", f"this stage holds {self.max_streams} streams already")
        self._next += 1
        if fork is None:
            self.stage.open_stream(self._next)
        else:
            self.stage.fork_stream(fork[0], self._next, fork[1])
        self.ids[name] = self._next
        return self._next

    def _known(self, name: str) -> int:
        sid = self.ids.get(name)
        if sid is None:
            raise ProtocolError("unknown_stream", f"unknown stream {name!r} (start it with start=true)")
        return sid

    def close(self, name: str) -> None:
        """End the stream: its KV blocks go back to the pool."""
        sid = self.ids.pop(name, None)
        if sid is not None:
            self.stage.close_stream(sid)

    def close_all(self) -> None:
        for name in list(self.ids):
            self.close(name)

    # -- Fwd: a step of one part --------------------------------------------------------------
    def forward(self, fwd: Fwd, x: np.ndarray) -> tuple[StageOutput, int]:
        """Run one Fwd's rows (``x``: ids [1, n] or hidden states [1, n, H], as the stateful
        Stage takes them): its output (on a last stage, the logits and argmax of the positions
        ``fwd.logits`` names, in that order) and the stream's position before the step."""
        stage = self.stage
        sid = self._open(fwd.stream) if fwd.start else self._known(fwd.stream)
        if fwd.rollback:
            try:
                stage.rollback(sid, fwd.rollback)
            except PoolError as e:
                raise StageError(str(e)) from None
        n = fwd.n
        rows = list(fwd.logits) if fwd.logits else [n - 1]
        k = n - min(rows) if stage.last else 0
        pos0 = stage.length(sid)
        try:
            res = stage.step([Entry(sid, x[0], k)])
        except PoolExhausted as e:
            raise ProtocolError("no_blocks", str(e)) from None
        if not stage.last:
            return StageOutput(hidden=res.hidden), pos0
        assert res.token_ids is not None and res.logits is not None
        pick = np.asarray(rows, dtype=np.int64) - (n - k)
        return StageOutput(token_ids=res.token_ids[pick], logits=res.logits[pick]), pos0

    # -- Batch: one infer call over its parts ---------------------------------------------------
    def batch(self, msg: Batch, payload: memoryview, keep: Sequence[int], wire: str) -> BatchOut:
        """Run the parts ``keep`` (indices into ``msg.parts``: those the event loop admitted) in
        one step; ``wire``: the dtype of hidden rows to the next hop. Blocking (compute thread)."""
        stage = self.stage
        parts = [msg.parts[i] for i in keep]
        out = BatchOut(frame=None)
        want = ("i32", "i64") if stage.first else ("f16", "f32")
        try:
            if msg.dtype not in want:
                what = "token ids" if stage.first else "hidden states"
                raise ProtocolError(
                    "bad_dtype", f"stage {stage.index} takes {what} ({'/'.join(want)}), not {msg.dtype}"
                )
            rows = batch_rows(msg, payload, 0 if stage.first else stage.hidden_size)
        except ProtocolError as e:
            out.failed = [ProtocolError(e.code, str(e), p.stream, p.seq) for p in parts]
            return out
        spans = msg.spans()
        cands = self._check(msg, keep, rows, spans, out.failed)
        cands = self._fit(cands, out.failed)
        if not cands:
            return out
        entries = self._prepare(cands)
        t0 = time.perf_counter()
        try:
            res = stage.step(entries)
        except (StageError, PoolExhausted, RuntimeError) as e:  # checked above: not expected
            code = "no_blocks" if isinstance(e, PoolExhausted) else "bad_input"
            out.failed += [ProtocolError(code, f"the step failed: {e}", c.part.stream, c.part.seq) for c in cands]
            return out
        out.seconds = time.perf_counter() - t0
        out.tokens = sum(c.part.n for c in cands)
        busy_ms = max(msg.busy_ms, out.seconds * 1000)
        if not stage.last:
            assert res.hidden is not None
            h = res.hidden.astype(np.float16) if wire == "f16" else res.hidden
            nxt = replace(msg, dtype=wire, parts=tuple(c.part for c in cands), busy_ms=busy_ms)
            out.frame = encode(nxt, h.tobytes())
        else:
            out.frame = encode(self._answer(msg, cands, entries, res, busy_ms))
        return out

    def _prepare(self, cands: list[_Cand]) -> list[Entry]:
        """The starts and rollbacks of the parts that run, then their forks (each source as it
        stands after its own rollback), and the step's entries in batch order."""
        stage = self.stage
        sids: dict[str, int] = {}
        for c in cands:
            p = c.part
            if p.fork is None:
                sids[p.stream] = self._open(p.stream) if p.start else self.ids[p.stream]
                if p.rollback:
                    stage.rollback(sids[p.stream], p.rollback)
        for c in cands:
            p = c.part
            if p.fork is not None:
                sids[p.stream] = self._open(p.stream, (self.ids[p.fork], p.fork_len))
        return [Entry(sids[c.part.stream], c.x, c.part.logits if stage.last else 0) for c in cands]

    def _check(
        self,
        msg: Batch,
        keep: Sequence[int],
        rows: np.ndarray,
        spans: list[tuple[int, int]],
        failed: list[ProtocolError],
    ) -> list[_Cand]:
        """The parts that pass their own checks (stream, rollback, fork, rows, the step's budget)."""
        stage = self.stage
        budget, used, new = stage.max_step_tokens, 0, 0
        parts = [msg.parts[i] for i in keep]
        starting = {p.stream for p in parts if p.start}
        rollbacks = {p.stream: p.rollback for p in parts if not p.start}
        out = []
        for i in keep:
            p = msg.parts[i]
            a, b = spans[i]
            x = rows[a:b].astype(np.int64 if stage.first else np.float32)
            try:
                if p.start and p.stream not in self.ids and len(self.ids) + new >= self.max_streams:
                    raise ProtocolError("too_many_streams", f"this stage holds {self.max_streams} streams already")
                base = self._base(p, starting, rollbacks)
                try:
                    stage.check(Entry(0, x, p.logits if stage.last else 0))
                except StageError as e:
                    raise ProtocolError("bad_input", str(e).removeprefix("stream 0: ")) from None
                if budget is not None and p.n > budget:
                    raise ProtocolError("bad_input", f"{p.n} rows: over this stage's step budget of {budget}")
                if budget is not None and used + p.n > budget:
                    raise ProtocolError("over_budget", f"{p.n} rows do not fit this step's budget of {budget} tokens")
            except ProtocolError as e:
                failed.append(ProtocolError(e.code, str(e), p.stream, p.seq))
                continue
            used += p.n
            new += p.start and p.stream not in self.ids
            out.append(_Cand(p, x, base))
        return out

    def _base(self, p: Part, starting: set[str], rollbacks: dict[str, int]) -> int:
        """The part's stream length before its rows (0 for a start, ``fork_len`` for a fork,
        the length less its rollback otherwise); ProtocolError when it cannot be had."""
        stage = self.stage
        if p.start and p.rollback:
            raise ProtocolError("bad_input", "a starting part cannot roll back")
        if p.fork is not None:
            src = self.ids.get(p.fork)
            if src is None:
                raise ProtocolError("unknown_stream", f"unknown stream {p.fork!r} to fork (it must run here first)")
            if p.fork in starting:
                raise ProtocolError(
                    "bad_input", f"stream {p.fork!r} starts in this micro-batch: fork it in a later one"
                )
            bs, have = stage.block_size, stage.length(src) - rollbacks.get(p.fork, 0)
            if p.fork_len % bs or p.fork_len > have:
                raise ProtocolError(
                    "bad_input",
                    f"cannot share {p.fork_len} positions of stream {p.fork!r}: it holds {have}, and a fork "
                    f"shares whole KV blocks of {bs} tokens",
                )
            return p.fork_len
        if p.start:
            return 0
        sid = self._known(p.stream)
        length = stage.length(sid)
        if p.rollback > length:
            raise ProtocolError("bad_input", f"cannot roll back {p.rollback} tokens of {length}")
        try:
            stage.pool.check_rollback(sid, p.rollback)
        except PoolError:
            raise ProtocolError(
                "bad_input",
                f"cannot roll back {p.rollback} tokens of {length}: the stream would end inside a KV block "
                f"another stream shares (roll back to a multiple of {stage.block_size} tokens)",
            ) from None
        return length - p.rollback

    def _fit(self, cands: list[_Cand], failed: list[ProtocolError]) -> list[_Cand]:
        """The parts the pool has blocks for: those that take none run (giving back what their
        start or rollback frees), then the others in order while free blocks last. A block
        another stream holds too is never counted as freed, a forked head never as new."""
        pool = self.stage.pool
        bs = pool.block_size
        for c in cands:
            p = c.part
            sid = self.ids.get(p.stream)
            kept = p.fork_len // bs if p.start else blocks_for(c.base, bs)
            freed = 0 if sid is None else pool.released(sid, 0 if p.start else c.base)
            c.delta = blocks_for(c.base + p.n, bs) - kept - freed
        free = pool.free_blocks - sum(c.delta for c in cands if c.delta <= 0)
        ok = []
        for c in cands:
            if c.delta > free:
                failed.append(
                    ProtocolError(
                        "no_blocks",
                        f"KV block pool exhausted: {c.part.n} new tokens need {c.delta} more block(s), {free} free",
                        c.part.stream,
                        c.part.seq,
                    )
                )
                continue
            free -= max(0, c.delta)
            ok.append(c)
        return ok

    def _answer(
        self, msg: Batch, cands: list[_Cand], entries: list[Entry], res: StepResult, busy_ms: float
    ) -> BatchIds:
        """The last stage's tokens for the parts that asked: argmax, or seeded sampling at each
        token's position in its stream (as the stateful path samples), and their
        log-probabilities for the parts that ask for those too."""
        streams: list[str] = []
        counts: list[int] = []
        tokens: list[int] = []
        logprobs: list[tuple[TokenLogprobs, ...] | None] = []
        for c, e in zip(cands, entries, strict=True):
            p = c.part
            if not p.logits:
                continue
            got = res.out(e.stream)
            assert got.token_ids is not None and got.logits is not None
            s = p.sampling
            sp = Sampling(s.temperature, s.top_p, s.seed)
            first = c.base + p.n - p.logits  # the stream position of its first token row
            toks = step_tokens(got.token_ids, got.logits, sp, range(first, first + p.logits))
            streams.append(p.stream)
            counts.append(len(toks))
            tokens += toks
            logprobs.append(step_logprobs(got.logits, toks, s))
        return BatchIds(
            term=msg.term,
            seq=msg.seq,
            streams=tuple(streams),
            counts=tuple(counts),
            tokens=tuple(tokens),
            sent_at=msg.sent_at,
            busy_ms=busy_ms,
            logprobs=None if all(lp is None for lp in logprobs) else tuple(logprobs),
        )
