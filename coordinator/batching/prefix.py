"""Prefix caching: prompt heads whose KV blocks stay on the stages for the next request (pure).

When a request ends, its stream's whole KV blocks can stay on every stage as an *entry* of
this cache instead of being freed. A later prompt that begins with the same tokens (a system
prompt, a conversation's earlier turns) starts as a fork of that entry: its stages share the
entry's first blocks and compute only the rest (``Part.fork``). Heads are matched a block at a
time by a chained hash, so equal keys mean equal tokens from the first position on.

Entries hold blocks the scheduler's ledger counts (:attr:`PrefixCache.held_blocks`); the least
recently used entry that no stream shares is evicted first, whenever the cache is over its
share of the pool or blocks are short.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MAX_ENTRIES = 32  # heads kept (each one is a stream on every stage)


def block_keys(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """One key per whole block of ``tokens``: a hash of every token up to that block's end."""
    keys, prev = [], b""
    arr = np.asarray(tokens, dtype=np.int32)
    for end in range(block_size, len(arr) + 1, block_size):
        prev = hashlib.blake2b(prev + arr[end - block_size : end].tobytes(), digest_size=16).digest()
        keys.append(prev)
    return keys


@dataclass
class Entry:
    name: str  # its stream on the stages
    keys: list[bytes]
    blocks: int  # blocks it alone holds (a fork's shared head is its parent's)
    parent: str | None = None  # the entry whose head it shares
    users: int = 0  # streams (and entries) sharing its blocks now
    used: int = 0  # when it was last matched or added


@dataclass(frozen=True)
class Hit:
    entry: str
    tokens: int  # positions shared (whole blocks)


@dataclass
class PrefixCache:
    block_size: int
    max_blocks: int  # blocks the entries may hold together
    max_entries: int = MAX_ENTRIES
    entries: dict[str, Entry] = field(default_factory=dict)
    _index: dict[bytes, tuple[str, int]] = field(default_factory=dict)  # key -> (entry, blocks up to it)
    _clock: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    prompt_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, tokens served from a cached head

    @property
    def held_blocks(self) -> int:
        return sum(e.blocks for e in self.entries.values())

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def lookup(self, prompt: Sequence[int]) -> Hit | None:
        """The longest cached head of ``prompt`` that leaves at least one token to compute."""
        self.prompt_tokens += len(prompt)
        best: tuple[str, int] | None = None
        for key in block_keys(prompt[:-1], self.block_size):
            found = self._index.get(key)
            if found is None:
                break
            best = found
        if best is None:
            return None
        name, n = best
        self.entries[name].used = next(self._clock)
        self.hit_tokens += n * self.block_size
        return Hit(name, n * self.block_size)

    def acquire(self, name: str) -> None:
        self.entries[name].users += 1

    def release(self, name: str | None) -> None:
        e = self.entries.get(name) if name is not None else None
        if e is not None and e.users > 0:
            e.users -= 1

    def add(self, name: str, tokens: Sequence[int], blocks: int, parent: str | None = None) -> list[str]:
        """Keep a finished stream (its KV holds ``tokens``; ``blocks`` of them its own) as an
        entry. Returns the streams to close on the stages: itself when it adds no new head, and
        entries evicted to stay under the limits."""
        keys = block_keys(tokens, self.block_size)
        if not keys or all(k in self._index for k in keys):
            return [name]
        self.entries[name] = Entry(name, keys, blocks, parent, used=next(self._clock))
        for i, k in enumerate(keys):
            self._index.setdefault(k, (name, i + 1))
        if parent is not None and parent in self.entries:
            self.acquire(parent)
        out: list[str] = []
        while len(self.entries) > self.max_entries or self.held_blocks > self.max_blocks:
            gone = self.evict_one(keep=name)
            if gone is None:
                break
            out.append(gone)
        return out

    def evict_one(self, keep: str | None = None) -> str | None:
        """Drop the least recently used entry no stream shares; its name (None: none can go)."""
        free = [e for e in self.entries.values() if e.users == 0 and e.name != keep]
        if not free:
            return None
        e = min(free, key=lambda e: e.used)
        del self.entries[e.name]
        for k in e.keys:
            if self._index.get(k, ("", 0))[0] == e.name:
                del self._index[k]
                for other in self.entries.values():  # another entry may hold the same head
                    if k in other.keys:
                        self._index[k] = (other.name, other.keys.index(k) + 1)
                        break
        self.release(e.parent)
        return e.name

    def clear(self) -> list[str]:
        """Forget every entry (the stages are gone or re-planned): their names."""
        names = list(self.entries)
        self.entries.clear()
        self._index.clear()
        return names
