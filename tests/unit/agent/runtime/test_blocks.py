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


# -- shared prompt heads (prefix caching) ---------------------------------------------------------


def forked() -> BlockPool:
    """Stream 1 holds 10 tokens in blocks 0, 1, 2; stream 2 forked its first 8 (blocks 0 and 1)
    and wrote 2 tokens of its own (block 3)."""
    pool = BlockPool(8, 4)
    pool.open(1)
    grown(pool, 1, 10)
    pool.fork(1, 2, 8)
    assert (pool.table(2), pool.length(2)) == ([0, 1], 8)
    grown(pool, 2, 2)
    return pool


def test_a_fork_shares_whole_blocks_and_writes_into_its_own() -> None:
    pool = forked()
    assert (pool.table(1), pool.table(2)) == ([0, 1, 2], [0, 1, 3])
    assert [pool.refs(b) for b in range(5)] == [2, 2, 1, 1, 0]
    assert pool.free_blocks == 4  # 4 blocks held, 2 of them by both
    assert (pool.shared(1), pool.shared(2)) == (2, 2)
    assert (pool.released(1, 0), pool.released(2, 0), pool.released(2, 4)) == (1, 1, 1)
    pool.fork(2, 3, 4)  # a fork of a fork
    assert pool.table(3) == [0] and pool.refs(0) == 3 and pool.free_blocks == 4
    pool.fork(1, 4, 0)  # sharing nothing is opening
    assert (pool.table(4), pool.length(4)) == ([], 0)


@pytest.mark.parametrize(
    ("src", "dst", "tokens", "match"),
    [
        (1, 3, 6, "cannot share 6 positions"),  # not whole blocks
        (1, 3, 12, "cannot share 12 positions of stream 1's 10"),  # more than the stream holds
        (1, 3, -4, "cannot share -4"),
        (1, 2, 4, "already open"),
        (9, 3, 4, "unknown stream 9"),
    ],
)
def test_bad_forks_are_refused_and_change_nothing(src: int, dst: int, tokens: int, match: str) -> None:
    pool = forked()
    refs = [pool.refs(b) for b in range(8)]
    with pytest.raises(PoolError, match=match):
        pool.fork(src, dst, tokens)
    assert [pool.refs(b) for b in range(8)] == refs and sorted(pool.streams) == [1, 2]


@pytest.mark.parametrize("first", [1, 2])
def test_blocks_come_back_when_their_last_holder_closes(first: int) -> None:
    pool = forked()
    pool.close(first)  # the shared blocks stay with the other stream
    other = 3 - first
    assert pool.free_blocks == 5 and [pool.refs(b) for b in (0, 1)] == [1, 1]
    assert pool.shared(other) == 0 and pool.released(other, 0) == 3
    grown(pool, other, 1)  # and it goes on in blocks of its own
    pool.close(other)
    assert pool.free_blocks == 8 and pool.streams == [] and not any(pool.refs(b) for b in range(8))


@pytest.mark.parametrize(
    ("stream", "r", "left", "free"),
    [
        (1, 2, 8, 5),  # the source lets go of its own third block
        (1, 6, 4, 5),  # ...and of shared block 1 (stream 2 keeps it)
        (1, 10, 0, 5),
        (2, 2, 8, 5),  # the fork lets go of its own block
        (2, 6, 4, 5),
        (2, 10, 0, 5),
        (1, 4, None, 4),  # to 6 tokens: it would end inside shared block 1, and write there next
        (1, 9, None, 4),
        (2, 3, None, 4),
    ],
)
def test_rollback_lets_go_of_shared_blocks_but_never_ends_inside_one(
    stream: int, r: int, left: int | None, free: int
) -> None:
    pool = forked()
    length = pool.length(stream)
    if left is None:
        with pytest.raises(PoolError, match="inside a block another stream shares"):
            pool.rollback(stream, r)
        assert pool.length(stream) == length
    else:
        pool.rollback(stream, r)
        assert pool.length(stream) == left
        grown(pool, stream, 3)  # its next tokens go into blocks of its own
        pool.rollback(stream, 3)
    assert pool.free_blocks == free
    pool.close(1)
    pool.close(2)
    assert pool.free_blocks == 8


def test_exhaustion_counts_shared_blocks_once() -> None:
    pool = BlockPool(4, 4)
    pool.open(1)
    grown(pool, 1, 8)
    pool.fork(1, 2, 8)  # takes no block
    assert pool.free_blocks == 2
    with pytest.raises(PoolExhausted, match="needs 3 more block"):
        pool.reserve([(2, 9)])
    assert pool.table(2) == [0, 1] and pool.free_blocks == 2
    pool.close(1)  # the source leaves: its blocks are stream 2's now, not free
    assert pool.free_blocks == 2
    grown(pool, 2, 8)
    assert pool.free_blocks == 0 and pool.released(2, 0) == 4
    pool.close(2)
    assert pool.free_blocks == 4


def test_random_forks_and_rollbacks_never_overwrite_what_another_stream_reads() -> None:
    """A seeded walk of grows, forks, rollbacks and closes over a small pool, writing each
    token's value into its block slot: every stream always reads back exactly its own tokens,
    every write lands in a block no other stream holds, and the counts add up."""
    rng = np.random.default_rng(7)
    pool = BlockPool(12, 4)
    memory: dict[int, dict[int, int]] = {b: {} for b in range(12)}
    want: dict[int, list[int]] = {}
    value = iter(range(1, 1 << 30))
    for _ in range(3000):
        streams = pool.streams
        op = rng.integers(4) if streams else 0
        s = int(rng.choice(streams)) if streams else 0
        if op == 0 and len(streams) < 6:  # open, or fork a stream's head
            new = max([*streams, 0]) + 1
            if streams and rng.random() < 0.7:
                tokens = 4 * int(rng.integers(0, pool.length(s) // 4 + 1))
                pool.fork(s, new, tokens)
                want[new] = want[s][:tokens]
            else:
                pool.open(new)
                want[new] = []
        elif op == 1:  # grow
            n = int(rng.integers(1, 7))
            try:
                pool.reserve([(s, n)])
            except PoolExhausted:
                continue
            table, at = pool.table(s), pool.length(s)
            for pos in range(at, at + n):
                block = table[pos // 4]
                assert pool.refs(block) == 1, "a write into a shared block"
                memory[block][pos % 4] = v = next(value)
                want[s].append(v)
            pool.commit(s, n)
        elif op == 2:  # roll back
            r = int(rng.integers(0, pool.length(s) + 1))
            try:
                pool.rollback(s, r)
            except PoolError:
                continue
            del want[s][len(want[s]) - r :]
        else:
            pool.close(s)
            del want[s]
        held: dict[int, int] = {}
        for t in pool.streams:
            table = pool.table(t)
            assert len(table) == blocks_for(pool.length(t), 4)
            assert [memory[table[p // 4]][p % 4] for p in range(pool.length(t))] == want[t]
            for b in table:
                held[b] = held.get(b, 0) + 1
        assert all(pool.refs(b) == held.get(b, 0) for b in range(12))
        assert pool.free_blocks == 12 - len(held)
    for t in pool.streams:
        pool.close(t)
    assert pool.free_blocks == 12
