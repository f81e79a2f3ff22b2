"""Read one tensor at a time from a GGUF file or a Hugging Face safetensors directory.

The exporter never materialises the whole model: it asks a :class:`Checkpoint` for the
tensors of one stage, by their Hugging Face names, and gets float32 numpy arrays back.
GGUF files are memory-mapped and dequantised per tensor; safetensors are read lazily.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


class CheckpointError(ValueError):
    """The checkpoint cannot be read or is not a supported model."""


def _gguf_name(hf_name: str) -> str | None:
    """Map a Hugging Face parameter name to the standard GGUF tensor name."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    parts = hf_name.split(".")
    if len(parts) < 5 or parts[0] != "model" or parts[1] != "layers":
        return None
    idx, rest = parts[2], ".".join(parts[3:])
    sub = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }.get(rest)
    return None if sub is None else f"blk.{idx}.{sub}"


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (GGUF stores llama q/k for interleaved RoPE)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class Checkpoint:
    """A model's config plus lazy access to its tensors by Hugging Face name."""

    config: Any  # transformers.PretrainedConfig
    path: Path

    def tensor(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        """Release file handles and mappings."""

    @property
    def model_type(self) -> str:
        return str(self.config.model_type)

    def lm_head_name(self) -> str:
        if self.has("lm_head.weight"):
            return "lm_head.weight"
        return "model.embed_tokens.weight"  # tied embeddings


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path, config: Any) -> None:
        import gguf

        self.path = path
        self.config = config
        self._reader = gguf.GGUFReader(str(path))
        self._tensors = {t.name: t for t in self._reader.tensors}

    def has(self, name: str) -> bool:
        g = _gguf_name(name)
        return g is not None and g in self._tensors

    def tensor(self, name: str) -> np.ndarray:
        from gguf import dequantize

        g = _gguf_name(name)
        if g is None or g not in self._tensors:
            raise CheckpointError(f"{self.path.name}: no tensor for {name}")
        t = self._tensors[g]
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if self.model_type == "llama" and (".attn_q." in g or ".attn_k." in g):
            heads = self.config.num_attention_heads if ".attn_q." in g else self.config.num_key_value_heads
            w = _unpermute_rope(w, heads)
        return np.ascontiguousarray(w)

    def rope_freq_factors(self) -> np.ndarray | None:
        """llama.cpp stores Llama 3 rope scaling as per-dimension frequency factors."""
        t = self._tensors.get("rope_freqs.weight")
        return None if t is None else np.asarray(t.data, dtype=np.float32).copy()

    def close(self) -> None:
        self._tensors.clear()
        del self._reader


class SafetensorsCheckpoint(Checkpoint):
    def __init__(self, path: Path, config: Any) -> None:
        from safetensors import safe_open

        self.path = path
        self.config = config
        self._index: dict[str, Path] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files")
        self._handles: dict[Path, Any] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():  # noqa: SIM118 (safe_open is not a dict)
                    self._index[k] = f

    def has(self, name: str) -> bool:
        return name in self._index

    def tensor(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        f = self._index.get(name)
        if f is None:
            raise CheckpointError(f"{self.path}: no tensor {name}")
        with safe_open(str(f), framework="pt") as h:
            t = h.get_tensor(name)
        return np.ascontiguousarray(t.float().numpy())


class RandomCheckpoint(Checkpoint):
    """Random weights in the model's exact shapes: for speed benchmarks where the real
    weights cannot travel (speed does not depend on the values). Deterministic per name."""

    def __init__(self, config: Any, seed: int = 0) -> None:
        self.path = Path("random")
        self.config = config
        self.seed = seed
        c = config
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        h, q, kv, i = c.hidden_size, c.num_attention_heads * hd, c.num_key_value_heads * hd, c.intermediate_size
        self._shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (c.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not getattr(c, "tie_word_embeddings", False):
            self._shapes["lm_head.weight"] = (c.vocab_size, h)
        bias = c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False))
        for n in range(c.num_hidden_layers):
            p = f"model.layers.{n}."
            self._shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
            if bias:
                self._shapes |= {p + f"self_attn.{x}_proj.bias": (d,) for x, d in (("q", q), ("k", kv), ("v", kv))}

    def has(self, name: str) -> bool:
        return name in self._shapes

    def tensor(self, name: str) -> np.ndarray:
        shape = self._shapes.get(name)
        if shape is None:
            raise CheckpointError(f"random checkpoint: no tensor {name}")
        if name.endswith("norm.weight"):
            return np.ones(shape, dtype=np.float32)
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        std = float(getattr(self.config, "initializer_range", 0.02) or 0.02)
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)


def load_config(path: Path) -> Any:
    """Hugging Face config of a model directory or GGUF file (GGUF: metadata only)."""
    from transformers import AutoConfig

    path = Path(path)
    try:
        if path.is_file():
            cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            cfg = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read a model config from {path}: {e}") from e
    check_supported(cfg)
    return cfg


def check_supported(cfg: Any) -> None:
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"unsupported architecture {mt!r}: lakeshard exports {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(Llama 1-3.x, SmolLM, Qwen2/2.5) models"
        )
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") == "dynamic":
        raise CheckpointError("dynamic NTK RoPE changes with sequence length and cannot be exported")


def open_checkpoint(path: Path, config: Any | None = None) -> Checkpoint:
    path = Path(path)
    if str(path) == "random":
        if config is None:
            raise CheckpointError("a random checkpoint needs the model's config")
        return RandomCheckpoint(config)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    cfg = config if config is not None else load_config(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path}: expected a .gguf file or a Hugging Face model directory")
        return GGUFCheckpoint(path, cfg)
    return SafetensorsCheckpoint(path, cfg)


@contextmanager
def opened(path: Path, config: Any | None = None) -> Iterator[Checkpoint]:
    ckpt = open_checkpoint(path, config)
    try:
        yield ckpt
    finally:
        ckpt.close()


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())
