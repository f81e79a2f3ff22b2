"""How much memory a paged stage gives its KV block pool: a share of what its node has free.

One pure rule, used where the pool is made (the stage host, when a paged stage is compiled:
free memory then, less the stage's weights) and where it is foretold (the capacity probe and
the mDNS advert say what a node would give; the planner says how many tokens of context a
plan holds). A quarter of the memory left once the weights are in, between 64 MiB and 1 GiB:
the laptop stays its owner's, and a pool needs no more than its users' contexts fill.
``LAKESHARD_KV_MEMORY`` (MiB) sets it outright.
"""

from __future__ import annotations

import os

MIB = 1 << 20
KV_SHARE = 0.25
KV_LEAST = 64 * MIB
KV_MOST = 1 << 30
KV_MEMORY_ENV = "LAKESHARD_KV_MEMORY"


class KvBudgetError(ValueError):
    pass


def kv_memory_override(environ: dict[str, str] | None = None) -> int | None:
    """``LAKESHARD_KV_MEMORY`` in bytes, None when unset; a clear error when it is not MiB."""
    v = (environ if environ is not None else os.environ).get(KV_MEMORY_ENV, "").strip()
    if not v:
        return None
    if not v.isdigit() or not 1 <= int(v) <= 1 << 20:
        raise KvBudgetError(f"{KV_MEMORY_ENV} must be a whole number of MiB from 1 to {1 << 20}, not {v!r}")
    return int(v) * MIB


def kv_pool_bytes(free: int, weights: int = 0, override: int | None = None) -> int:
    """The pool a stage gets with ``free`` bytes available before its ``weights`` load."""
    if override is not None:
        return override
    room = max(0, free - weights)
    return int(min(KV_MOST, max(KV_LEAST, room * KV_SHARE)))


def context_tokens(pool: int, token_bytes: int) -> int:
    """Tokens of context (all streams together) a pool of ``pool`` bytes holds at
    ``token_bytes`` per token of its stage."""
    return pool // token_bytes if token_bytes > 0 else 0
