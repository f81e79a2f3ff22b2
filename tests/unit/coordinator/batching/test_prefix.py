"""The prefix cache's index: which cached head a prompt shares, and what is evicted when."""

from __future__ import annotations

import pytest

from coordinator.batching.prefix import PrefixCache, block_keys

BS = 4
SYSTEM = list(range(100, 112))  # 3 whole blocks


def cache(max_blocks: int = 100, max_entries: int = 8) -> PrefixCache:
    return PrefixCache(block_size=BS, max_blocks=max_blocks, max_entries=max_entries)


def test_keys_chain_every_token_before_them() -> None:
    a, b = block_keys([1, 2, 3, 4, 5, 6, 7, 8], BS), block_keys([9, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # the second block is equal, its head not
    assert block_keys([1, 2, 3], BS) == []


@pytest.mark.parametrize(
    "prompt,shared",
    [
        ([*SYSTEM, 1, 2, 3], 12),  # the whole cached head
        (SYSTEM, 8),  # at least one token is left to compute: the last block is recomputed
        ([*SYSTEM[:6], 0, 0, 0, 0], 4),  # equal up to the second block
        ([0, *SYSTEM], 0),  # shifted: nothing shared
        (SYSTEM[:3], 0),  # shorter than a block
    ],
)
def test_a_prompt_shares_the_longest_cached_head_of_whole_blocks(prompt: list[int], shared: int) -> None:
    c = cache()
    assert c.add("s1", [*SYSTEM, 7, 7], blocks=4) == []
    hit = c.lookup(prompt)
    assert (hit.tokens if hit else 0) == shared
    if hit:
        assert hit.entry == "s1"
    assert c.hit_tokens == shared and c.prompt_tokens == len(prompt)


def test_a_stream_that_adds_no_new_head_is_closed_not_kept() -> None:
    c = cache()
    c.add("s1", SYSTEM, blocks=3)
    assert c.add("s2", [*SYSTEM, 1], blocks=4) == ["s2"]
    assert list(c.entries) == ["s1"] and c.held_blocks == 3


def test_the_least_recently_used_unshared_entry_goes_first() -> None:
    c = cache(max_blocks=8)
    c.add("a", [1] * 8, blocks=2)
    c.add("b", [2] * 8, blocks=2)
    c.lookup([1] * 9)  # a is used again
    c.acquire("b")  # b is shared by a running stream
    assert c.add("c", [3] * 16, blocks=4) == []  # 8 blocks: within the limit
    assert c.add("d", [4] * 8, blocks=2) == ["a"]  # 10 > 8: a is older than c, b is shared
    assert set(c.entries) == {"b", "c", "d"}
    c.release("b")
    assert c.evict_one() == "b"
    assert c.lookup([2] * 9) is None


def test_a_fork_kept_as_an_entry_holds_its_parent() -> None:
    c = cache()
    c.add("p", SYSTEM, blocks=3)
    hit = c.lookup([*SYSTEM, 5, 5, 5, 5, 5])
    assert hit is not None and hit.entry == "p"
    c.acquire("p")
    c.add("child", [*SYSTEM, 5, 5, 5, 5, 5], blocks=1, parent="p")
    c.release("p")  # the stream ended; its entry still shares p's blocks
    assert c.evict_one() == "child"  # p cannot go while child holds it
    assert c.evict_one() == "p"
    assert c.evict_one() is None and c.held_blocks == 0


def test_the_deepest_head_may_be_a_forks() -> None:
    c = cache()
    c.add("p", SYSTEM, blocks=3)
    c.add("child", SYSTEM + [5] * 4, blocks=1, parent="p")
    hit = c.lookup(SYSTEM + [5] * 4 + [6])
    assert hit is not None and (hit.entry, hit.tokens) == ("child", 16)
    assert sorted(c.clear()) == ["child", "p"] and c.lookup([*SYSTEM, 1]) is None
