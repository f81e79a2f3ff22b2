"""One compiled stage and its streams: one InferRequest (own KV state) per stream.

A stream keeps a valid-slot mask over the physical KV slots, the physical length and the
logical position. Rolling back r speculative slots zeroes their mask entries and steps the
logical position back; nothing in the KV state is read or written.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from agent.runtime.device import choose_device, compile_model
from agent.runtime.device_profile import compile_properties, model_per_stream

log = logging.getLogger(__name__)


class StageError(ValueError):
    """Bad input for a stage (shape, dtype, size, unknown stream): the caller's fault."""


@dataclass
class StageOutput:
    hidden: np.ndarray | None = None  # [1, n, H] for inner stages
    token_ids: np.ndarray | None = None  # [k] chosen by argmax on the last stage
    logits: np.ndarray | None = None  # [k, V] on the last stage


def _shared(x: np.ndarray) -> ov.Tensor:
    """A tensor over ``x``'s memory (a private copy only if x is not contiguous and writable)."""
    if not (x.flags.c_contiguous and x.flags.writeable):
        x = np.array(x, order="C", copy=True)
    return ov.Tensor(x, shared_memory=True)


def run_head_part(head: ov.InferRequest, hidden: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A part of the vocabulary head (``head.xml``) over final hidden states [1, n, width]: each
    position's best logit among its rows and that token's id."""
    h = hidden
    if h.dtype != np.float32 or h.ndim != 3 or h.shape[0] != 1 or h.shape[2] != width:
        raise StageError(f"the head part takes float32 [1, n, {width}], got {h.dtype} {h.shape}")
    # a tensor over memory that stays alive until the inference is done (a read-only view is copied)
    x = h if h.flags.c_contiguous and h.flags.writeable else np.array(h, order="C")
    head.set_tensor("hidden_states", ov.Tensor(x, shared_memory=True))
    head.infer()
    return head.get_tensor("top_values").data[0].copy(), head.get_tensor("top_ids").data[0].copy()


# Masked (rolled-back) slots still cost attention time. Compacting reads and writes every
# layer's cache (about one decode step), so it is done only once the junk is both large in
# absolute terms and a sizeable fraction of the cache: then its cost is repaid within a few
# steps of cheaper attention, while short rollbacks never pay it.
COMPACT_MIN_SLOTS = 64
COMPACT_FRACTION = 0.25


def should_compact(phys: int, masked: int) -> bool:
    """Whether a stream's KV cache with ``masked`` junk slots out of ``phys`` should be compacted."""
    return masked >= COMPACT_MIN_SLOTS and masked >= COMPACT_FRACTION * phys


class Stream:
    """Per-stream state on one stage."""

    def __init__(self, request: ov.InferRequest) -> None:
        self.request = request
        self._mask = np.zeros(256, dtype=np.int64)
        self.phys = 0  # physical KV slots written
        self.pos = 0  # logical position of the next token

    def reset(self) -> None:
        self.request.reset_state()
        self.phys = self.pos = 0
        self._mask[:] = 0

    def rollback(self, r: int) -> None:
        """Disable the last ``r`` written slots (rejected speculative tokens)."""
        if r < 0 or r > self.phys:
            raise StageError(f"cannot roll back {r} slots of {self.phys}")
        if r:
            self._mask[self.phys - r : self.phys] = 0
            self.pos -= r

    def masked_slots(self) -> int:
        return int(self.phys - self._mask[: self.phys].sum())

    def maybe_compact(self) -> bool:
        if should_compact(self.phys, self.masked_slots()):
            self.compact()
            return True
        return False

    def _rewrite_states(self, keep: np.ndarray) -> None:
        """Keep only the KV slots ``keep`` (indices into the physical slots) in every state."""
        for state in self.request.query_state():
            kv = state.state.data  # [batch, kv_heads, phys, head_dim]
            if kv.ndim != 4 or kv.shape[2] != self.phys:
                raise StageError(f"unexpected KV state shape {kv.shape} for {self.phys} slots")
            state.state = ov.Tensor(np.ascontiguousarray(kv[:, :, keep, :]))

    def trim(self, r: int) -> None:
        """Physically remove the last ``r`` slots from the KV state (the costly alternative to
        :meth:`rollback`: a read and a write of every layer's cache)."""
        if r < 0 or r > self.phys:
            raise StageError(f"cannot trim {r} slots of {self.phys}")
        if r:
            valid = int(self._mask[self.phys - r : self.phys].sum())
            self._rewrite_states(np.arange(self.phys - r))
            self._mask[self.phys - r : self.phys] = 0
            self.phys -= r
            self.pos -= valid

    def compact(self) -> None:
        """Drop every masked slot from the KV state; logical positions are unchanged (RoPE is
        already applied to the cached keys), so later output is the same."""
        keep = np.flatnonzero(self._mask[: self.phys])
        if keep.size == self.phys:
            return
        self._rewrite_states(keep)
        self._mask[: keep.size] = 1
        self._mask[keep.size : self.phys] = 0
        self.phys = int(keep.size)

    def _mask_for(self, n: int) -> np.ndarray:
        need = self.phys + n
        if need > self._mask.shape[0]:
            grown = np.zeros(max(need, 2 * self._mask.shape[0]), dtype=np.int64)
            grown[: self.phys] = self._mask[: self.phys]
            self._mask = grown
        self._mask[self.phys : need] = 1
        return self._mask[None, :need]


class Stage:
    """A compiled stage IR. Thread-safe per stream (one request per stream)."""

    def __init__(
        self,
        stage_dir: Path,
        *,
        device: str = "AUTO",
        threads: int | None = None,
        exact: bool = False,
        kv_precision: str | None = None,
        per_stream: bool | None = None,
    ) -> None:
        """``per_stream``: a compiled model for each stream (default: where the device needs it,
        :func:`~agent.runtime.device_profile.model_per_stream`); a closed stream's model is reused."""
        self.dir = Path(stage_dir)
        self.manifest: dict[str, Any] = json.loads((self.dir / "manifest.json").read_text())
        st = self.manifest["stage"]
        self.index, self.count = int(st["index"]), int(st["count"])
        self.first, self.last = bool(st["first"]), bool(st["last"])
        self.full_logits = bool(self.manifest.get("full_logits", False))
        self.hidden_size = int(self.manifest["hidden_size"])
        self.vocab_size = int(self.manifest["vocab_size"])
        self.device = choose_device(device)
        props = compile_properties(self.device, threads=threads, exact=exact, kv_precision=kv_precision)
        self.compiled = compile_model(self.dir / "model.xml", self.device, props)
        self.per_stream = model_per_stream(self.device) if per_stream is None else per_stream
        self._props = props
        self._spare: list[ov.CompiledModel] = [self.compiled]  # models no open stream uses (per_stream)
        self.models_compiled = 1
        names = {p.get_any_name() for p in self.compiled.inputs}
        self.has_beam_idx = "beam_idx" in names
        # The last stage of a split also gives its final hidden states, so that the vocabulary
        # head can be skipped here (an empty logits_idx) and computed in parts (head_top).
        self.hidden_out = self.last and any(p.get_any_name() == "hidden_states_out" for p in self.compiled.outputs)
        part = self.manifest.get("head_part")
        self.head_rows: tuple[int, int] | None = None
        self._head: ov.InferRequest | None = None
        if part and (self.dir / "head.xml").is_file():
            self.head_rows = (int(part["rows"][0]), int(part["rows"][1]))
            self._head = compile_model(self.dir / "head.xml", self.device, props).create_infer_request()
        self.main_input = "input_ids" if self.first else "hidden_states"
        self._beam = ov.Tensor(np.zeros(1, dtype=np.int32))
        self._lock = threading.Lock()

    def head_top(self, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This stage's part of the vocabulary head (rows ``head_rows``) for final hidden states
        [1, n, H]: each position's best logit among those rows and its token id. Stateless;
        on the compute thread, like :meth:`forward`."""
        if self._head is None:
            raise StageError("this stage holds no part of the vocabulary head")
        return run_head_part(self._head, hidden, self.hidden_size)

    @property
    def layers(self) -> tuple[int, int]:
        st = self.manifest["stage"]
        return int(st["layer_start"]), int(st["layer_end"])

    def open_stream(self) -> Stream:
        if not self.per_stream:
            with self._lock:
                return Stream(self.compiled.create_infer_request())
        with self._lock:
            model = self._spare.pop() if self._spare else None
        if model is None:  # a new stream beside open ones: a model of its own (seconds; cached kernels)
            model = compile_model(self.dir / "model.xml", self.device, self._props)
            with self._lock:
                self.models_compiled += 1
        stream = Stream(model.create_infer_request())
        weakref.finalize(stream, self._give_back, model)  # a closed stream's model serves the next
        return stream

    def _give_back(self, model: ov.CompiledModel) -> None:
        with self._lock:
            self._spare.append(model)

    def check_input(self, x: np.ndarray) -> None:
        if self.first:
            if x.dtype != np.int64 or x.ndim != 2 or x.shape[0] != 1 or x.shape[1] < 1:
                raise StageError(f"stage {self.index} expects token ids int64 [1, n], got {x.dtype} {x.shape}")
            if x.size and (x.min() < 0 or x.max() >= self.vocab_size):
                raise StageError(f"token id out of range 0..{self.vocab_size - 1}")
        elif x.dtype != np.float32 or x.ndim != 3 or x.shape[0] != 1 or x.shape[2] != self.hidden_size:
            raise StageError(
                f"stage {self.index} expects hidden states float32 [1, n, {self.hidden_size}], got {x.dtype} {x.shape}"
            )

    def forward(
        self, stream: Stream, x: np.ndarray, *, logits_idx: np.ndarray | None = None, validate: bool = True
    ) -> StageOutput:
        """Run ``n`` new positions through this stage for ``stream`` (blocking; call off the loop).

        On the last stage, ``logits_idx`` picks which of the n positions produce a token
        (default: the last one).
        """
        if validate:
            self.check_input(x)
        n = int(x.shape[1])
        trunk = self.last and logits_idx is not None and logits_idx.size == 0
        if trunk and not self.hidden_out:
            raise StageError("this stage cannot skip its vocabulary head (no hidden_states_out)")
        if self.last and logits_idx is not None and not trunk:
            if logits_idx.ndim != 1 or logits_idx.size == 0 or logits_idx.min() < 0 or logits_idx.max() >= n:
                raise StageError(f"logits positions must lie in 0..{n - 1}")
            if logits_idx.dtype != np.int64:
                logits_idx = logits_idx.astype(np.int64)
        # Inputs are bound as tensors sharing the numpy buffers (no copies, no dict dispatch):
        # the per-call overhead matters when a stage computes for only a few milliseconds.
        req = stream.request
        positions = np.arange(stream.pos, stream.pos + n, dtype=np.int64)[None, :]
        req.set_tensor(self.main_input, _shared(x))
        req.set_tensor("attention_mask", ov.Tensor(stream._mask_for(n), shared_memory=True))
        req.set_tensor("position_ids", ov.Tensor(positions, shared_memory=True))
        if self.has_beam_idx:
            req.set_tensor("beam_idx", self._beam)
        if self.last and not self.full_logits:
            idx = logits_idx if logits_idx is not None else np.array([n - 1], dtype=np.int64)
            req.set_tensor("logits_idx", ov.Tensor(idx, shared_memory=True))
        req.start_async()
        req.wait()
        stream.phys += n
        stream.pos += n
        if not self.last or trunk:
            return StageOutput(hidden=req.get_tensor("hidden_states_out").data)
        logits = req.get_tensor("logits").data[0]
        if self.full_logits:
            logits = logits[logits_idx] if logits_idx is not None else logits[-1:]
            return StageOutput(token_ids=np.argmax(logits, axis=-1), logits=logits)
        return StageOutput(token_ids=req.get_tensor("token_ids").data[0], logits=logits)
