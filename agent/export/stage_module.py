"""A torch module for one pipeline stage (a contiguous range of decoder layers).

It is written for tracing into OpenVINO, with the KV cache as explicit inputs and outputs
(made stateful afterwards). The math follows the Hugging Face Llama / Qwen2 modules exactly:
RMSNorm in float32, rotate-half RoPE with the checkpoint's own inverse frequencies (rope
scaling included, computed by transformers itself), grouped-query attention through SDPA.

Masking works on *physical* KV slots: ``attention_mask`` has one entry per slot already in
the cache plus one per new token, and a query may attend to any earlier slot whose mask entry
is 1. ``position_ids`` carry the *logical* positions used by RoPE. Keeping the two apart is
what lets a rejected speculative slot be switched off by the mask alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class StageSpec:
    index: int
    count: int
    layer_start: int  # inclusive
    layer_end: int  # exclusive

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)


def rope_inv_freq(config: Any, freq_factors: np.ndarray | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, computed by transformers' own rotary module
    (so every rope_scaling type it supports, "llama3" included, matches the checkpoint)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rot = LlamaRotaryEmbedding(config)
    inv = rot.inv_freq.detach().float().clone()
    if freq_factors is not None:  # llama.cpp's rope_freqs tensor (Llama 3 scaling stored in a GGUF)
        inv = inv / torch.from_numpy(freq_factors).float()
    return inv, float(rot.attention_scaling)


class RMSNorm(nn.Module):
    def __init__(self, weight: np.ndarray, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.from_numpy(weight), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def _linear(w: np.ndarray, b: np.ndarray | None) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    lin.weight = nn.Parameter(torch.from_numpy(w), requires_grad=False)
    if b is not None:
        lin.bias = nn.Parameter(torch.from_numpy(b), requires_grad=False)
    return lin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, ckpt: Any, i: int) -> None:
        super().__init__()
        p = f"model.layers.{i}."
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        eps = config.rms_norm_eps

        get = ckpt.tensor

        def opt(name: str) -> np.ndarray | None:
            return get(name) if ckpt.has(name) else None

        self.input_layernorm = RMSNorm(get(p + "input_layernorm.weight"), eps)
        self.post_attention_layernorm = RMSNorm(get(p + "post_attention_layernorm.weight"), eps)
        a = p + "self_attn."
        self.q_proj = _linear(get(a + "q_proj.weight"), opt(a + "q_proj.bias"))
        self.k_proj = _linear(get(a + "k_proj.weight"), opt(a + "k_proj.bias"))
        self.v_proj = _linear(get(a + "v_proj.weight"), opt(a + "v_proj.bias"))
        self.o_proj = _linear(get(a + "o_proj.weight"), opt(a + "o_proj.bias"))
        m = p + "mlp."
        self.gate_proj = _linear(get(m + "gate_proj.weight"), None)
        self.up_proj = _linear(get(m + "up_proj.weight"), None)
        self.down_proj = _linear(get(m + "down_proj.weight"), None)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = torch.cat([past_k, k], dim=2)
        v = torch.cat([past_v, v], dim=2)
        rep = self.heads // self.kv_heads
        if rep > 1:
            kb, kh, kt, kd = k.shape
            k_all = k[:, :, None, :, :].expand(kb, kh, rep, kt, kd).reshape(kb, kh * rep, kt, kd)
            v_all = v[:, :, None, :, :].expand(kb, kh, rep, kt, kd).reshape(kb, kh * rep, kt, kd)
        else:
            k_all, v_all = k, v
        attn = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=bias, scale=self.head_dim**-0.5)
        attn = attn.transpose(1, 2).reshape(b, n, self.heads * self.head_dim)
        x = x + self.o_proj(attn)
        h = self.post_attention_layernorm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x, k, v


class StageModule(nn.Module):
    """Layers ``spec.layers`` of the model; embeddings on the first stage, head on the last.

    Inputs (in order): ``input_ids`` [B, n] (first stage) or ``hidden_states`` [B, n, H];
    ``attention_mask`` [B, T] with T = cached slots + n; ``position_ids`` [B, n];
    on the last stage ``logits_idx`` [k] (which of the n positions get logits);
    then past key and value for each layer.
    Outputs: ``hidden_states_out`` (or ``logits`` [B, k, V] and ``token_ids`` [B, k] on the last
    stage, and there, in a split of 2 stages or more, also ``hidden_states_out``: the final
    hidden states of all n positions before the norm, for a :class:`HeadPart` elsewhere), then
    present key and value for each layer. An empty ``logits_idx`` skips the vocabulary head.
    With ``full_logits`` (the monolithic GenAI-compatible export) the last stage has no
    ``logits_idx`` input, returns logits for all n positions and no argmax.
    """

    def __init__(
        self,
        config: Any,
        ckpt: Any,
        spec: StageSpec,
        *,
        full_logits: bool = False,
        freq_factors: np.ndarray | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.full_logits = full_logits
        self.hidden_out = spec.last and spec.count > 1 and not full_logits
        get = ckpt.tensor
        if spec.first:
            self.embed_tokens = nn.Parameter(torch.from_numpy(get("model.embed_tokens.weight")), requires_grad=False)
        self.layers = nn.ModuleList([DecoderLayer(config, ckpt, i) for i in spec.layers])
        if spec.last:
            self.norm = RMSNorm(get("model.norm.weight"), config.rms_norm_eps)
            self.lm_head = nn.Parameter(torch.from_numpy(get(ckpt.lm_head_name())), requires_grad=False)
        inv_freq, self.rope_scale = rope_inv_freq(config, freq_factors)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *rest: Any) -> Any:
        spec = self.spec
        if spec.last and not self.full_logits:
            logits_idx, past = rest[0], rest[1:]
        else:
            logits_idx, past = None, rest
        h = F.embedding(x, self.embed_tokens) if spec.first else x
        n = h.shape[1]
        total = attention_mask.shape[1]
        q_pos = torch.arange(n, dtype=torch.int64) + (total - n)
        k_pos = torch.arange(total, dtype=torch.int64)
        causal = k_pos[None, :] <= q_pos[:, None]
        allowed = causal[None, None, :, :] & (attention_mask[:, None, None, :] > 0)
        bias = torch.where(allowed, 0.0, torch.finfo(torch.float32).min).to(torch.float32)

        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale)[:, None, :, :]
        sin = (emb.sin() * self.rope_scale)[:, None, :, :]

        presents = []
        for j, layer in enumerate(self.layers):
            h, k, v = layer(h, cos, sin, bias, past[2 * j], past[2 * j + 1])
            presents += [k, v]
        if not spec.last:
            return (h, *presents)
        final = h
        if logits_idx is not None:
            h = torch.index_select(h, 1, logits_idx)
        logits = F.linear(self.norm(h), self.lm_head)
        if self.full_logits:
            return (logits, *presents)
        if self.hidden_out:
            return (logits, torch.argmax(logits, dim=-1), final, *presents)
        return (logits, torch.argmax(logits, dim=-1), *presents)


def head_rows(vocab: int, index: int, count: int, share: float) -> tuple[int, int] | None:
    """The vocabulary rows of the head part a stage holds in a split of ``count`` stages:
    stage 0 the first ``share`` of them, the last stage the rest; none for other stages."""
    if count < 2 or index not in (0, count - 1):
        return None
    cut = max(1, min(vocab - 1, round(vocab * share)))
    return (0, cut) if index == 0 else (cut, vocab)


class HeadPart(nn.Module):
    """Rows ``rows`` of the vocabulary head, after the final norm: hidden states [B, n, H] in,
    each position's best logit among those rows (``top_values`` [B, n]) and its token id
    (``top_ids`` [B, n]) out. Two parts on two stages give the whole head's greedy token:
    the larger value wins, the lower id on a tie, as argmax over all rows picks."""

    def __init__(self, config: Any, ckpt: Any, rows: tuple[int, int]) -> None:
        super().__init__()
        a, b = rows
        self.offset = a
        self.norm = RMSNorm(ckpt.tensor("model.norm.weight"), config.rms_norm_eps)
        w = np.ascontiguousarray(ckpt.tensor(ckpt.lm_head_name())[a:b])
        self.weight = nn.Parameter(torch.from_numpy(w), requires_grad=False)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(self.norm(h), self.weight)
        values, ids = torch.max(logits, dim=-1)
        return values, ids + self.offset
