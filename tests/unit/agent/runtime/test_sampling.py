"""Sampling is a deterministic function of (logits, settings, seed, position)."""

from __future__ import annotations

import numpy as np
import pytest

from agent.runtime.sampling import Sampling, choose_token


def test_greedy_is_argmax() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=1000).astype(np.float32)
        assert choose_token(logits, Sampling(), position=5) == int(np.argmax(logits))


def test_same_seed_and_position_same_token_whoever_computes_it() -> None:
    logits = np.random.default_rng(1).normal(size=5000).astype(np.float32)
    s = Sampling(temperature=1.0, top_p=0.95, seed=42)
    picks = [choose_token(logits, s, position=p) for p in range(50)]
    assert picks == [choose_token(logits.copy(), s, position=p) for p in range(50)]
    other_seed = [choose_token(logits, Sampling(temperature=1.0, top_p=0.95, seed=43), p) for p in range(50)]
    assert picks != other_seed
    assert len(set(picks)) > 10  # positions draw independent noise


def test_frequencies_follow_the_softmax() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float64)).astype(np.float32)
    s = Sampling(temperature=1.0, seed=7)
    counts = np.bincount([choose_token(logits, s, p) for p in range(20000)], minlength=4) / 20000
    assert np.allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.015)


def test_temperature_sharpens_and_top_p_truncates() -> None:
    logits = np.log(np.array([0.6, 0.3, 0.1])).astype(np.float32)
    cold = [choose_token(logits, Sampling(temperature=0.1, seed=3), p) for p in range(2000)]
    assert np.mean(np.array(cold) == 0) > 0.99
    nucleus = {choose_token(logits, Sampling(temperature=1.0, top_p=0.5, seed=3), p) for p in range(2000)}
    assert nucleus == {0}
    two = {choose_token(logits, Sampling(temperature=1.0, top_p=0.85, seed=3), p) for p in range(2000)}
    assert two == {0, 1}


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5}, {"seed": -3}]
)
def test_bad_settings_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Sampling(**kwargs)  # type: ignore[arg-type]
