"""A paged, batched stage: many streams' tokens in one infer call, KV in blocks of a shared pool.

The stateful :class:`~agent.runtime.stage.Stage` runs one InferRequest per stream, so streams
never share a matrix multiply and each re-reads the stage's weights per token. Here the stage
IR is rewritten at load by OpenVINO's ``paged_attention_transformation`` (what OpenVINO GenAI's
continuous batching applies): attention becomes PagedAttention over per-layer KV block tensors
that this stage owns, and one :meth:`PagedStage.step` packs every stream's new tokens (decode
tokens and prefill chunks alike) into one call. A stream's length is its past length: rolling
back r tokens shortens it and frees whole blocks (no masked junk, no compaction).

Where the rewrite or its compilation fails (the NPU plugin runs stateful models only), loading
raises :class:`PagedUnavailable` and the caller keeps the stateful Stage; :func:`attention_path`
is the one place that says which path a device gets.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import openvino as ov
from openvino import opset13 as ops

from agent.runtime.blocks import BlockPool, Layout, PoolError, PoolExhausted, layout
from agent.runtime.device import choose_device, compile_model, core, prune_compiled_cache
from agent.runtime.device_profile import compile_properties
from agent.runtime.stage import StageError, run_head_part

__all__ = ["Entry", "PagedStage", "PagedUnavailable", "PoolExhausted", "StepResult", "attention_path"]

AttentionPath = Literal["paged", "stateful"]
# Tokens a KV block holds, per plugin, as OpenVINO GenAI's cache manager uses them.
BLOCK_SIZE = {"CPU": 32, "GPU": 16}
DEFAULT_KV_BYTES = 256 << 20


class PagedUnavailable(RuntimeError):
    """This stage cannot run paged on this device (the rewrite or compilation failed): use the stateful Stage."""


def attention_path(device: str, override: str | None = None) -> AttentionPath:
    """``paged`` where the plugin runs PagedAttention (CPU, GPU), ``stateful`` elsewhere (NPU).

    ``override`` (default: the ``LAKESHARD_ATTENTION`` environment variable) forces one path;
    ``auto`` (or nothing) leaves the choice to the device.
    """
    forced = (override if override is not None else os.environ.get("LAKESHARD_ATTENTION", "")).strip().lower()
    if forced in ("paged", "stateful"):
        return "paged" if forced == "paged" else "stateful"
    if forced not in ("", "auto"):
        raise ValueError(f"LAKESHARD_ATTENTION must be auto, paged or stateful, not {forced!r}")
    return "paged" if device.split(".")[0].upper() in BLOCK_SIZE else "stateful"


def paged_model(xml: Path, *, first: bool) -> ov.Model:
    """Read a stage IR and rewrite its attention as PagedAttention (KV as block-table inputs).

    The rewrite finds a model's main input by name: an inner stage's ``hidden_states`` is
    renamed ``inputs_embeds`` first. Our last stage gathers the ``logits_idx`` positions along
    the sequence axis; packed, the tokens lie along axis 0, so that gather is moved there.
    """
    from openvino._offline_transformations import paged_attention_transformation

    model = core().read_model(str(xml))
    if not first:
        port = model.input("hidden_states")
        port.get_tensor().set_names({"inputs_embeds"})
        port.get_node().set_friendly_name("inputs_embeds")
    paged_attention_transformation(model, False, False)
    names = {p.get_any_name() for p in model.inputs}
    if "past_lens" not in names:
        raise PagedUnavailable(f"{xml}: the paged-attention rewrite found no attention to convert")
    if "logits_idx" in names:
        _gather_tokens_on_axis0(model)
    return model


def _gather_tokens_on_axis0(model: ov.Model) -> None:
    idx = model.input("logits_idx").get_node()
    for target in idx.output(0).get_target_inputs():
        op = target.get_node()
        if op.get_type_name() != "Gather" or target.get_index() != 1:
            continue
        moved = ops.gather(op.input_value(0), op.input_value(1), ops.constant(np.int64(0)))
        for consumer in op.output(0).get_target_inputs():
            consumer.replace_source_output(moved.output(0))
    model.validate_nodes_and_infer_types()


@dataclass(frozen=True)
class Entry:
    """One stream's part of a step: its new tokens (ids [n] on stage 0, hidden rows [n, H]
    elsewhere) and, on the last stage, how many of its last positions produce a token."""

    stream: int
    x: np.ndarray
    logits: int = 1


@dataclass(frozen=True)
class StreamOut:
    hidden: np.ndarray | None = None  # [n, H] on inner stages
    token_ids: np.ndarray | None = None  # [k] argmax on the last stage
    logits: np.ndarray | None = None  # [k, V] on the last stage


@dataclass
class StepResult:
    """A step's outputs, packed in entry order (the shape a micro-batch frame carries)."""

    streams: list[int]
    spans: np.ndarray  # [B+1] where each stream's rows start in ``hidden``
    logit_spans: np.ndarray  # [B+1] where each stream's tokens start in ``token_ids``/``logits``
    hidden: np.ndarray | None = None  # [T, H]
    token_ids: np.ndarray | None = None  # [K]
    logits: np.ndarray | None = None  # [K, V]
    _index: dict[int, int] = field(default_factory=dict)

    def out(self, stream: int) -> StreamOut:
        if not self._index:
            self._index = {s: i for i, s in enumerate(self.streams)}
        i = self._index[stream]
        a, b = int(self.spans[i]), int(self.spans[i + 1])
        c, d = int(self.logit_spans[i]), int(self.logit_spans[i + 1])
        return StreamOut(
            hidden=None if self.hidden is None else self.hidden[a:b],
            token_ids=None if self.token_ids is None else self.token_ids[c:d],
            logits=None if self.logits is None else self.logits[c:d],
        )


class PagedStage:
    """A compiled paged stage IR with its KV block pool. One step at a time (a lock)."""

    def __init__(
        self,
        stage_dir: Path,
        *,
        device: str = "CPU",
        threads: int | None = None,
        exact: bool = False,
        kv_precision: str | None = None,
        properties: dict[str, Any] | None = None,
        num_blocks: int | None = None,
        kv_bytes: int = DEFAULT_KV_BYTES,
        max_step_tokens: int | None = None,
    ) -> None:
        """``properties`` override the compile properties of :func:`compile_properties`;
        the pool holds ``num_blocks`` blocks, else as many as fit in ``kv_bytes``; a step of
        more than ``max_step_tokens`` tokens (the scheduler's budget) is refused."""
        self.dir = Path(stage_dir)
        self.manifest: dict[str, Any] = json.loads((self.dir / "manifest.json").read_text())
        st = self.manifest["stage"]
        self.index, self.count = int(st["index"]), int(st["count"])
        self.first, self.last = bool(st["first"]), bool(st["last"])
        self.layers = int(st["layer_start"]), int(st["layer_end"])
        self.hidden_size = int(self.manifest["hidden_size"])
        self.vocab_size = int(self.manifest["vocab_size"])
        self.max_step_tokens = max_step_tokens
        self.device = choose_device(device)
        kind = self.device.split(".")[0].upper()
        if attention_path(self.device, override="") != "paged":
            raise PagedUnavailable(f"{self.device} does not run PagedAttention")
        props = compile_properties(self.device, threads=threads, exact=exact, kv_precision=kv_precision)
        self.properties = {**props, **(properties or {})}
        try:
            model = paged_model(self.dir / "model.xml", first=self.first)
            self.compiled = core().compile_model(model, self.device, self.properties)
        except PagedUnavailable:
            raise
        except Exception as e:  # OpenVINO raises RuntimeError and friends, with long messages
            raise PagedUnavailable(f"stage {self.index} does not compile paged on {self.device}: {e}") from e
        prune_compiled_cache()
        self.block_size = BLOCK_SIZE[kind]
        inputs = {p.get_any_name(): p for p in self.compiled.inputs}
        self.main_input = "input_ids" if self.first else "inputs_embeds"
        self.has_logits_idx = "logits_idx" in inputs
        self.kv_layers = sorted(int(n.split(".")[1]) for n in inputs if n.startswith("key_cache."))
        self._kv_ports = [inputs[f"{kind}_cache.{i}"] for i in self.kv_layers for kind in ("key", "value")]
        self.block_bytes = sum(_bytes_per_block(p) for p in self._kv_ports)
        blocks = num_blocks if num_blocks is not None else max(1, kv_bytes // max(1, self.block_bytes))
        self.pool = BlockPool(int(blocks), self.block_size)
        self.request = self.compiled.create_infer_request()
        self.kv_precision = str(self._kv_ports[0].get_element_type().get_type_name()) if self._kv_ports else ""
        for port in self._kv_ports:
            shape = [int(blocks), *(d.get_length() for d in list(port.get_partial_shape())[1:])]
            tensor = ov.Tensor(port.get_element_type(), ov.Shape(shape))
            np.asarray(tensor.data).view(np.uint8)[...] = 0
            self.request.set_tensor(port, tensor)
        # Stage 0 of a split answers a stateful last stage's request for its rows of the
        # vocabulary head (a paged last stage never splits its head).
        part = self.manifest.get("head_part")
        self.head_rows: tuple[int, int] | None = None
        self._head: ov.InferRequest | None = None
        if self.first and part and (self.dir / "head.xml").is_file():
            self.head_rows = (int(part["rows"][0]), int(part["rows"][1]))
            self._head = compile_model(self.dir / "head.xml", self.device, self.properties).create_infer_request()
        self._lock = threading.Lock()

    def head_top(self, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stage 0's part of a split vocabulary head, as :meth:`agent.runtime.stage.Stage.head_top`."""
        if self._head is None:
            raise StageError("this stage holds no part of the vocabulary head")
        return run_head_part(self._head, hidden, self.hidden_size)

    # streams -----------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return self.pool.free_blocks

    def open_stream(self, stream: int) -> None:
        with self._lock:
            self.pool.open(stream)

    def fork_stream(self, src: int, dst: int, tokens: int) -> None:
        """Open ``dst`` on ``src``'s first ``tokens`` positions (a multiple of
        :attr:`block_size`, at most ``src``'s length): it shares those KV blocks as they are (no
        copy, no compute) and its own tokens start at position ``tokens``. PoolError otherwise."""
        with self._lock:
            self.pool.fork(src, dst, tokens)

    def close_stream(self, stream: int) -> None:
        with self._lock:
            self.pool.close(stream)

    def rollback(self, stream: int, r: int) -> None:
        """Forget the stream's last ``r`` tokens (rejected speculation); frees whole blocks
        (PoolError, nothing changed, if that would end it inside a block another stream shares)."""
        with self._lock:
            self.pool.rollback(stream, r)

    def length(self, stream: int) -> int:
        return self.pool.length(stream)

    # steps -------------------------------------------------------------------------------
    def check(self, e: Entry) -> int:
        """The entry's new token count; StageError when it does not fit this stage (dtype,
        shape, token ids out of range, more logits than tokens)."""
        x = e.x
        if self.first:
            if x.dtype != np.int64 or x.ndim != 1 or x.shape[0] < 1:
                raise StageError(f"stream {e.stream}: stage 0 takes token ids int64 [n], got {x.dtype} {x.shape}")
            if x.min() < 0 or x.max() >= self.vocab_size:
                raise StageError(f"stream {e.stream}: token id out of range 0..{self.vocab_size - 1}")
        elif x.dtype != np.float32 or x.ndim != 2 or x.shape[0] < 1 or x.shape[1] != self.hidden_size:
            raise StageError(
                f"stream {e.stream}: stage {self.index} takes hidden rows float32 [n, {self.hidden_size}], "
                f"got {x.dtype} {x.shape}"
            )
        n = int(x.shape[0])
        if self.last and not 0 <= e.logits <= n:
            raise StageError(f"stream {e.stream}: {e.logits} logits asked of {n} new tokens")
        return n

    def step(self, entries: Sequence[Entry]) -> StepResult:
        """Run every entry's new tokens through this stage in ONE infer call (blocking: call it
        off the event loop). Raises :class:`PoolExhausted` (nothing changed) when the pool
        cannot hold the step, StageError on bad input (nothing changed)."""
        if not entries:
            raise StageError("an empty step")
        sizes = [self.check(e) for e in entries]
        if self.max_step_tokens is not None and sum(sizes) > self.max_step_tokens:
            raise StageError(f"a step of {sum(sizes)} tokens is over this stage's budget of {self.max_step_tokens}")
        wants = [e.logits if self.last else 0 for e in entries]
        with self._lock:
            try:
                self.pool.reserve([(e.stream, n) for e, n in zip(entries, sizes, strict=True)])
            except PoolError as err:
                raise StageError(str(err)) from err
            lay = layout(self.pool, [(e.stream, n, k) for e, n, k in zip(entries, sizes, wants, strict=True)])
            x = np.concatenate([e.x for e in entries]) if len(entries) > 1 else np.ascontiguousarray(entries[0].x)
            try:
                res = self._infer(x, lay)
            except Exception:
                for e in entries:  # blocks reserved for tokens never written go back
                    self.pool.rollback(e.stream, 0)
                raise
            for e, n in zip(entries, sizes, strict=True):
                self.pool.commit(e.stream, n)
        res.streams = [e.stream for e in entries]
        return res

    def _infer(self, x: np.ndarray, lay: Layout) -> StepResult:
        req = self.request

        def bind(name: str, a: np.ndarray) -> None:
            req.set_tensor(name, ov.Tensor(a if a.flags.c_contiguous else np.ascontiguousarray(a), shared_memory=True))

        bind(self.main_input, x)
        bind("position_ids", lay.position_ids)
        bind("past_lens", lay.past_lens)
        bind("subsequence_begins", lay.subsequence_begins)
        bind("block_indices", lay.block_indices)
        bind("block_indices_begins", lay.block_indices_begins)
        bind("max_context_len", lay.max_context_len)
        if self.has_logits_idx:
            bind("logits_idx", lay.logits_idx)
        req.infer()
        out = StepResult(streams=[], spans=lay.subsequence_begins, logit_spans=lay.logits_begins)
        if not self.last:
            out.hidden = np.array(req.get_tensor("hidden_states_out").data, copy=True).reshape(-1, self.hidden_size)
            return out
        logits = req.get_tensor("logits").data.reshape(-1, self.vocab_size)
        if self.has_logits_idx:
            out.logits = np.array(logits, copy=True)
            out.token_ids = np.array(req.get_tensor("token_ids").data, copy=True).reshape(-1)
        else:  # a full-logits IR: every position's logits came out; keep the wanted ones
            out.logits = logits[lay.logits_idx]
            out.token_ids = np.argmax(out.logits, axis=-1)
        return out


def _bytes_per_block(port: ov.Output) -> int:
    dims = list(port.get_partial_shape())[1:]
    if not all(d.is_static for d in dims):
        raise PagedUnavailable(f"the plugin left the KV cache shape {port.get_partial_shape()} open")
    return int(np.prod([d.get_length() for d in dims])) * int(port.get_element_type().bitwidth) // 8
