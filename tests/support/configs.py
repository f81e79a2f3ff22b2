"""Model configs as the planner reads them (the fields of a Hugging Face config.json it uses)."""

from __future__ import annotations

from types import SimpleNamespace

# Qwen2.5-0.5B (and Qwen2.5-Coder-0.5B): 24 layers, 2 KV heads of 64
QWEN05 = SimpleNamespace(
    hidden_size=896,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    num_hidden_layers=24,
    vocab_size=151936,
    head_dim=64,
)
