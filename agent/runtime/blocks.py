"""The KV block pool of a paged stage, and the batch layout PagedAttention reads (pure Python).

A paged stage keeps every layer's KV cache as one tensor of fixed-size blocks. Each stream owns
a list of blocks (its block table) holding its tokens in order: token t of a stream lives in
block ``table[t // block_size]`` at slot ``t % block_size``. A stream grows a block at a time,
gives its trailing whole blocks back when rolled back (speculative tokens rejected), and all of
them when closed. Nothing here touches OpenVINO, so the bookkeeping is tested by tables.

Blocks are reference-counted, so streams can share a prompt head (prefix caching):
:meth:`BlockPool.fork` opens a stream whose table starts with another stream's first whole
blocks, computed once. A block is free again only when its last holder closes or rolls back
past it. The invariant that keeps shared KV intact: a stream writes only into blocks it holds
alone. Forks share whole (full) blocks only, so a stream's next position always lies in a
block of its own, or at a block boundary; the one call that could break this, a rollback that
leaves a stream ending inside a shared block, is refused (:meth:`BlockPool.check_rollback`),
and :meth:`BlockPool.reserve` checks it again before any write.

:func:`layout` turns one step's entries (stream, new token count, wanted logits) into the
inputs PagedAttention takes, in OpenVINO GenAI's convention:

- ``past_lens[i]``: tokens of stream i already in the cache;
- ``subsequence_begins`` [B+1]: where each stream's new tokens start in the packed batch;
- ``block_indices``: each stream's table, covering its past and new tokens, concatenated;
- ``block_indices_begins`` [B+1]: where each stream's table starts in ``block_indices``;
- ``max_context_len``: the longest past + new length in the batch;
- ``position_ids``: each new token's position in its stream (past_len, past_len + 1, ...).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class PoolExhausted(RuntimeError):
    """Not enough free KV blocks for a step: nothing was allocated; the caller makes a stream wait."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"KV block pool exhausted: this step needs {needed} more block(s), {free} free")
        self.needed, self.free = needed, free


class PoolError(ValueError):
    """A call that does not fit the pool's state (unknown or duplicate stream, rollback past the start)."""


def blocks_for(tokens: int, block_size: int) -> int:
    """How many blocks hold ``tokens`` tokens."""
    return -(-tokens // block_size)


class BlockPool:
    """A fixed number of KV blocks shared by the streams of one stage.

    Free blocks are handed out lowest index first, so the same sequence of calls always gives
    the same tables (block ids change no output, but reproducible tables make failures readable).
    Each block counts the streams whose tables hold it; the free list holds those of count 0.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise PoolError(f"a pool needs at least one block of at least one token, not {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks))  # a heap
        self._refs = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    @property
    def free_blocks(self) -> int:
        """Blocks no stream holds."""
        return len(self._free)

    def refs(self, block: int) -> int:
        """How many streams hold ``block``."""
        return self._refs[block]

    @property
    def streams(self) -> list[int]:
        return list(self._tables)

    def has(self, stream: int) -> bool:
        return stream in self._tables

    def open(self, stream: int) -> None:
        """Start an empty stream (no blocks until it has tokens)."""
        if stream in self._tables:
            raise PoolError(f"stream {stream} is already open")
        self._tables[stream], self._lengths[stream] = [], 0

    def fork(self, src: int, dst: int, tokens: int) -> None:
        """Open ``dst`` sharing ``src``'s first ``tokens`` positions: its table starts with the
        blocks that hold them (each now held once more), its length is ``tokens``. ``tokens``
        must be a multiple of the block size (only whole blocks are shared) and at most
        ``src``'s length; ``dst``'s own tokens then start in a block of its own."""
        length = self._lengths[self._known(src)]
        if dst in self._tables:
            raise PoolError(f"stream {dst} is already open")
        if tokens < 0 or tokens % self.block_size or tokens > length:
            raise PoolError(
                f"stream {dst} cannot share {tokens} positions of stream {src}'s {length}: "
                f"a fork shares whole blocks of {self.block_size} tokens that the stream holds"
            )
        head = self._tables[src][: tokens // self.block_size]
        for block in head:
            self._refs[block] += 1
        self._tables[dst], self._lengths[dst] = list(head), tokens

    def shared(self, stream: int) -> int:
        """How many of the stream's blocks another stream holds too."""
        return sum(self._refs[b] > 1 for b in self._tables[self._known(stream)])

    def released(self, stream: int, keep: int) -> int:
        """Blocks that would be free again if the stream kept only its first ``keep`` tokens
        (0: if it closed): those past them that no other stream holds."""
        table = self._tables[self._known(stream)]
        return sum(self._refs[b] == 1 for b in table[blocks_for(keep, self.block_size) :])

    def length(self, stream: int) -> int:
        return self._lengths[self._known(stream)]

    def table(self, stream: int) -> list[int]:
        return list(self._tables[self._known(stream)])

    def _known(self, stream: int) -> int:
        if stream not in self._tables:
            raise PoolError(f"unknown stream {stream}")
        return stream

    def needed(self, growth: Sequence[tuple[int, int]]) -> int:
        """Blocks that growing each (stream, new tokens) would take from the free list."""
        total = 0
        for stream, n in growth:
            have = len(self._tables[self._known(stream)])
            total += max(0, blocks_for(self._lengths[stream] + n, self.block_size) - have)
        return total

    def reserve(self, growth: Sequence[tuple[int, int]]) -> None:
        """Give each stream the blocks for its ``n`` new tokens, all or nothing.

        Raises :class:`PoolExhausted` (and allocates nothing) when the free blocks do not cover
        the whole step. Lengths do not change until :meth:`commit`.
        """
        seen: set[int] = set()
        for stream, n in growth:
            if stream in seen:
                raise PoolError(f"stream {stream} appears twice in one step")
            if n < 0:
                raise PoolError(f"stream {stream}: a negative token count ({n})")
            seen.add(stream)
            self._check_private_tail(stream)
        need = self.needed(growth)
        if need > len(self._free):
            raise PoolExhausted(need, len(self._free))
        for stream, n in growth:
            table = self._tables[stream]
            while len(table) < blocks_for(self._lengths[stream] + n, self.block_size):
                block = heapq.heappop(self._free)
                self._refs[block] = 1
                table.append(block)

    def _check_private_tail(self, stream: int) -> None:
        """The invariant: every block the stream may write into (the one holding its next
        position, and on) is its alone."""
        table = self._tables[self._known(stream)]
        for block in table[self._lengths[stream] // self.block_size :]:
            if self._refs[block] != 1:
                raise PoolError(f"stream {stream} would write into block {block}, which another stream shares")

    def commit(self, stream: int, n: int) -> None:
        """Record that ``n`` tokens were written after the stream's current length."""
        length = self._lengths[self._known(stream)] + n
        if n < 0 or blocks_for(length, self.block_size) > len(self._tables[stream]):
            raise PoolError(f"stream {stream}: {n} tokens were never reserved")
        self._lengths[stream] = length

    def check_rollback(self, stream: int, r: int) -> None:
        """PoolError unless the stream can forget its last ``r`` tokens: at most its length, and
        not ending inside a block another stream shares (its next token would be written there;
        rolling back to a block boundary, or past shared blocks, only lets go of them)."""
        length = self._lengths[self._known(stream)]
        if r < 0 or r > length:
            raise PoolError(f"cannot roll back {r} tokens of stream {stream}'s {length}")
        left = length - r
        if left % self.block_size and self._refs[self._tables[stream][left // self.block_size]] > 1:
            raise PoolError(
                f"cannot roll back stream {stream} to {left} tokens: that ends inside a block another stream "
                f"shares (a shared head can be let go of only to a multiple of {self.block_size} tokens)"
            )

    def rollback(self, stream: int, r: int) -> None:
        """Forget the stream's last ``r`` tokens; blocks it leaves wholly unused are let go of
        (free again unless another stream holds them). See :meth:`check_rollback`."""
        self.check_rollback(stream, r)
        self._lengths[stream] -= r
        self._trim(stream)

    def _trim(self, stream: int) -> None:
        table = self._tables[stream]
        keep = blocks_for(self._lengths[stream], self.block_size)
        for block in table[keep:]:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                heapq.heappush(self._free, block)
        del table[keep:]

    def close(self, stream: int) -> None:
        """End a stream: it lets go of every block it held (free again unless shared)."""
        self._lengths[self._known(stream)] = 0
        self._trim(stream)
        del self._tables[stream], self._lengths[stream]


@dataclass(frozen=True)
class Layout:
    """One step's PagedAttention inputs (see the module docstring) and where outputs land."""

    position_ids: np.ndarray  # int64 [T]
    past_lens: np.ndarray  # int32 [B]
    subsequence_begins: np.ndarray  # int32 [B+1]
    block_indices: np.ndarray  # int32 [sum of blocks]
    block_indices_begins: np.ndarray  # int32 [B+1]
    max_context_len: np.ndarray  # int32 scalar
    logits_idx: np.ndarray  # int64 [K]: rows of the packed batch that produce a token
    logits_begins: np.ndarray  # int64 [B+1]: where each stream's tokens start among the K

    @property
    def tokens(self) -> int:
        return int(self.subsequence_begins[-1])


def layout(pool: BlockPool, entries: Sequence[tuple[int, int, int]]) -> Layout:
    """The inputs of one step over ``entries`` = (stream, new tokens n, logits wanted k).

    The streams' blocks must already be reserved for the new tokens (:meth:`BlockPool.reserve`);
    the k wanted logits are those of each stream's last k new tokens.
    """
    b = len(entries)
    past = np.empty(b, dtype=np.int32)
    sub = np.zeros(b + 1, dtype=np.int32)
    blk_begins = np.zeros(b + 1, dtype=np.int32)
    lg_begins = np.zeros(b + 1, dtype=np.int64)
    tables: list[list[int]] = []
    positions: list[np.ndarray] = []
    picks: list[np.ndarray] = []
    longest = 0
    for i, (stream, n, k) in enumerate(entries):
        if n < 1 or not 0 <= k <= n:
            raise PoolError(f"stream {stream}: {n} new tokens with {k} logits wanted")
        start = pool.length(stream)
        need = blocks_for(start + n, pool.block_size)
        table = pool.table(stream)
        if len(table) < need:
            raise PoolError(f"stream {stream}: blocks for {n} new tokens were not reserved")
        past[i] = start
        sub[i + 1] = sub[i] + n
        tables.append(table[:need])
        blk_begins[i + 1] = blk_begins[i] + need
        lg_begins[i + 1] = lg_begins[i] + k
        positions.append(np.arange(start, start + n, dtype=np.int64))
        picks.append(np.arange(sub[i + 1] - k, sub[i + 1], dtype=np.int64))
        longest = max(longest, start + n)
    return Layout(
        position_ids=np.concatenate(positions) if positions else np.empty(0, dtype=np.int64),
        past_lens=past,
        subsequence_begins=sub,
        block_indices=np.asarray([x for t in tables for x in t], dtype=np.int32),
        block_indices_begins=blk_begins,
        max_context_len=np.array(longest, dtype=np.int32),
        logits_idx=np.concatenate(picks) if picks else np.empty(0, dtype=np.int64),
        logits_begins=lg_begins,
    )
