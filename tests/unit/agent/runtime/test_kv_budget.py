"""The KV pool a paged stage takes: a share of its node's free memory, within bounds."""

from __future__ import annotations

import pytest

from agent.runtime.kv_budget import (
    KV_LEAST,
    KV_MOST,
    MIB,
    KvBudgetError,
    context_tokens,
    kv_memory_override,
    kv_pool_bytes,
)

GIB = 1 << 30


@pytest.mark.parametrize(
    ("free", "weights", "override", "pool"),
    [
        (16 * GIB, 0, None, KV_MOST),  # a roomy laptop: the ceiling, the rest stays its owner's
        (2 * GIB, 1 * GIB, None, 256 * MIB),  # a quarter of what the weights leave
        (1 * GIB, 0, None, 256 * MIB),
        (300 * MIB, 280 * MIB, None, KV_LEAST),  # almost nothing left: still a usable pool
        (0, 0, None, KV_LEAST),
        (16 * GIB, 0, 100 * MIB, 100 * MIB),  # LAKESHARD_KV_MEMORY wins
    ],
)
def test_pool_size(free: int, weights: int, override: int | None, pool: int) -> None:
    assert kv_pool_bytes(free, weights, override) == pool


def test_the_override_is_read_in_mib_and_bad_values_say_so() -> None:
    assert kv_memory_override({}) is None
    assert kv_memory_override({"LAKESHARD_KV_MEMORY": "512"}) == 512 * MIB
    for bad in ("0", "-3", "1.5", "lots"):
        with pytest.raises(KvBudgetError, match="LAKESHARD_KV_MEMORY"):
            kv_memory_override({"LAKESHARD_KV_MEMORY": bad})


def test_context_tokens() -> None:
    # Qwen2.5-0.5B whole on a CPU stage: 24 layers x 2 KV heads x 64 x K,V x f32 = 24 KiB a token
    assert context_tokens(KV_MOST, 24 * 1024) == 43690
    assert context_tokens(KV_MOST, 0) == 0
