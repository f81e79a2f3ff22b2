"""The KV block pool of a paged stage and the PagedAttention inputs it lays out (pure logic)."""

from __future__ import annotations

import numpy as np
import pytest

from agent.runtime.blocks import BlockPool, PoolError, PoolExhausted, blocks_for, layout


def grown(pool: BlockPool, stream: int, n: int) -> None:
    pool.reserve([(stream, n)])
    pool.commit(stream, n)


@pytest.mark.parametrize(
    ("tokens", "size", "blocks"),
    [(0, 32, 0), (1, 32, 1), (32, 32, 1), (33, 32, 2), (64, 32, 2), (65, 16, 5)],
)
def test_blocks_for(tokens: int, size: int, blocks: int) -> None:
    assert blocks_for(tokens, size) == blocks


def test_streams_take_blocks_as_they_grow_and_give_them_all_back() -> None:
    pool = BlockPool(8, 4)
    pool.open(1)
    pool.open(2)
    assert pool.table(1) == [] and pool.free_blocks == 8
    grown(pool, 1, 5)  # 5 tokens: 2 blocks
    grown(pool, 2, 3)
    grown(pool, 1, 3)  # 8 tokens: still 2 blocks
    assert (pool.table(1), pool.table(2)) == ([0, 1], [2])
    assert pool.length(1) == 8 and pool.free_blocks == 5
    grown(pool, 1, 1)
    assert pool.table(1) == [0, 1, 3]
    pool.close(1)
    assert pool.free_blocks == 7
    grown(pool, 2, 2)  # the lowest free block is reused first
    assert pool.table(2) == [2, 0]
    pool.close(2)
    assert pool.free_blocks == 8 and pool.streams == []


@pytest.mark.parametrize(
    ("length", "r", "left", "blocks"),
    [
        (10, 0, 10, 3),
        (10, 1, 9, 3),
        (10, 2, 8, 2),  # the third block held tokens 8 and 9 only: freed
        (10, 6, 4, 1),
        (10, 7, 3, 1),
        (10, 10, 0, 0),
    ],
)
def test_rollback_shortens_and_frees_whole_blocks(length: int, r: int, left: int, blocks: int) -> None:
    pool = BlockPool(6, 4)
    pool.open(7)
    grown(pool, 7, length)
    pool.rollback(7, r)
    assert pool.length(7) == left
    assert len(pool.table(7)) == blocks
    assert pool.free_blocks == 6 - blocks


def test_rollback_past_the_start_is_refused() -> None:
    pool = BlockPool(4, 4)
    pool.open(1)
    grown(pool, 1, 3)
    with pytest.raises(PoolError, match="cannot roll back 4"):
        pool.rollback(1, 4)
    with pytest.raises(PoolError, match="cannot roll back -1"):
        pool.rollback(1, -1)
    assert pool.length(1) == 3


def test_an_exhausted_pool_allocates_nothing_for_the_step() -> None:
    pool = BlockPool(3, 4)
    for s in (1, 2):
        pool.open(s)
    grown(pool, 1, 4)
    with pytest.raises(PoolExhausted, match="needs 3 more block") as err:
        pool.reserve([(1, 1), (2, 8)])  # 1 more block for stream 1, 2 for stream 2: 3 > 2 free
    assert (err.value.needed, err.value.free) == (3, 2)
    assert pool.table(1) == [0] and pool.table(2) == [] and pool.free_blocks == 2
    pool.reserve([(1, 1), (2, 4)])  # exactly what is free
    assert pool.free_blocks == 0


def test_bad_calls_are_clear_errors() -> None:
    pool = BlockPool(4, 4)
    pool.open(1)
    with pytest.raises(PoolError, match="already open"):
        pool.open(1)
    with pytest.raises(PoolError, match="unknown stream 9"):
        pool.reserve([(9, 1)])
    with pytest.raises(PoolError, match="twice"):
        pool.reserve([(1, 1), (1, 1)])
    with pytest.raises(PoolError, match="never reserved"):
        pool.commit(1, 5)
    with pytest.raises(PoolError, match="unknown stream 2"):
        pool.close(2)
    with pytest.raises(PoolError, match="at least one block"):
        BlockPool(0, 32)


def test_layout_of_a_mixed_step() -> None:
    """Stream 1 decodes one token after 5, stream 2 prefills 6 tokens, stream 3 verifies 3 tokens
    after 4 (speculation: all three positions produce a token)."""
    pool = BlockPool(16, 4)
    for s in (1, 2, 3):
        pool.open(s)
    grown(pool, 1, 5)  # blocks 0, 1
    grown(pool, 3, 4)  # block 2
    step = [(1, 1, 1), (2, 6, 1), (3, 3, 3)]
    pool.reserve([(s, n) for s, n, _ in step])  # 1 keeps 2 blocks; 2 takes 3, 4; 3 takes 5
    lay = layout(pool, step)
    assert lay.past_lens.tolist() == [5, 0, 4]
    assert lay.subsequence_begins.tolist() == [0, 1, 7, 10]
    assert lay.block_indices.tolist() == [0, 1, 3, 4, 2, 5]
    assert lay.block_indices_begins.tolist() == [0, 2, 4, 6]
    assert int(lay.max_context_len) == 7
    assert lay.position_ids.tolist() == [5, 0, 1, 2, 3, 4, 5, 4, 5, 6]
    assert lay.logits_idx.tolist() == [0, 6, 7, 8, 9]
    assert lay.logits_begins.tolist() == [0, 1, 2, 5]
    assert lay.tokens == 10
    assert lay.past_lens.dtype == lay.block_indices.dtype == np.int32
    assert lay.position_ids.dtype == lay.logits_idx.dtype == np.int64


def test_layout_of_a_chunk_that_wants_no_token() -> None:
    pool = BlockPool(4, 4)
    pool.open(1)
    pool.reserve([(1, 3)])
    lay = layout(pool, [(1, 3, 0)])
    assert lay.logits_idx.tolist() == [] and lay.logits_begins.tolist() == [0, 0]


@pytest.mark.parametrize(("n", "k"), [(0, 0), (2, 3), (2, -1)])
def test_layout_refuses_counts_that_do_not_add_up(n: int, k: int) -> None:
    pool = BlockPool(4, 4)
    pool.open(1)
    pool.reserve([(1, max(n, 0))])
    with pytest.raises(PoolError, match="new tokens with"):
        layout(pool, [(1, n, k)])


def test_layout_needs_the_blocks_reserved() -> None:
    pool = BlockPool(4, 4)
    pool.open(1)
    with pytest.raises(PoolError, match="not reserved"):
        layout(pool, [(1, 2, 1)])
