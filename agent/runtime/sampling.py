"""Token choice as a pure, deterministic function of (logits, sampling settings, seed, position).

Greedy is argmax. Sampling is Gumbel-max over the top-p nucleus of softmax(logits / T), with
the noise drawn from a generator keyed by (seed, position): the same request gives the same
tokens however it is scheduled, split or speculated.

What a client may ask besides the tokens, their log-probabilities (:func:`token_logprobs`), is
the model's own distribution (the logits' log-softmax, at temperature 1), as OpenAI reports it,
whatever the temperature or top-p that chose them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature > 100:
            raise ValueError("temperature must be between 0 and 100")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if not (0 <= self.seed < 2**63):
            raise ValueError("seed must be a non-negative 64-bit integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def gumbel_noise(n: int, seed: int, position: int) -> np.ndarray:
    rng = np.random.Generator(np.random.Philox(key=[seed & (2**64 - 1), position & (2**64 - 1)]))
    u = rng.random(n)
    return -np.log(-np.log(np.clip(u, 1e-300, 1.0 - 1e-16)))


def choose_token(logits: np.ndarray, s: Sampling, position: int) -> int:
    """The token for ``position`` given that position's logits (1-D)."""
    if s.greedy:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / s.temperature
    if s.top_p < 1.0:
        order = np.argsort(-z, kind="stable")
        p = np.exp(z[order] - z[order[0]])
        p /= p.sum()
        keep = int(np.searchsorted(np.cumsum(p), s.top_p) + 1)
        cut = np.full_like(z, -np.inf)
        cut[order[:keep]] = z[order[:keep]]
        z = cut
    return int(np.argmax(z + gumbel_noise(z.shape[0], s.seed, position)))


def step_tokens(token_ids: np.ndarray, logits: np.ndarray, s: Sampling, positions: Sequence[int]) -> tuple[int, ...]:
    """A last stage's tokens for one stream's step: the graph's argmax ids when greedy, else one
    seeded choice per row of ``logits``, row k at stream position ``positions[k]`` (so a token is
    the same whichever stage layout, batch or attention path computed it)."""
    if s.greedy:
        return tuple(int(t) for t in token_ids)
    return tuple(choose_token(logits[k], s, pos) for k, pos in enumerate(positions))


def token_logprobs(
    logits: np.ndarray, tokens: Sequence[int], top: int, floor: float = -9999.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each chosen token's log-probability and its row's ``top`` most likely tokens: row k of
    ``logits`` [k, V] chose ``tokens[k]``. The log-softmax is computed stably in float64 (the
    largest logit taken out first); the alternatives are found by a partial sort (argpartition,
    no sort of the vocabulary), then ordered most likely first (on a tie, the lower id first).
    Returns float64 [k], int64 [k, n] and float64 [k, n], n = min(top, V); log-probabilities
    below ``floor`` (an impossible token's -inf) are sent as ``floor``."""
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim != 2 or z.shape[0] != len(tokens):
        raise ValueError(f"logits of shape {z.shape} for {len(tokens)} tokens")
    m = z.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(z - m).sum(axis=1, keepdims=True))
    rows = np.arange(z.shape[0])
    chosen = z[rows, np.asarray(tokens, dtype=np.int64)] - lse[:, 0]
    n = max(0, min(top, z.shape[1]))
    if n == 0:
        ids = np.zeros((z.shape[0], 0), dtype=np.int64)
        values = np.zeros((z.shape[0], 0), dtype=np.float64)
    else:
        ids = np.argpartition(-z, n - 1, axis=1)[:, :n] if n < z.shape[1] else np.tile(np.arange(n), (len(rows), 1))
        best = z[rows[:, None], ids]
        order = np.lexsort((ids, -best), axis=1)
        ids = np.take_along_axis(ids, order, axis=1).astype(np.int64)
        values = np.take_along_axis(best, order, axis=1) - lse

    def clean(v: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.clip(np.nan_to_num(v, nan=floor, neginf=floor, posinf=0.0), floor, 0.0)
        return out

    return clean(chosen), ids, clean(values)
