"""The last stage's log-probabilities of its chosen tokens: the logits' log-softmax at temperature 1
at each chosen token, and the most likely alternatives by a partial sort, most likely first."""

from __future__ import annotations

import numpy as np
import pytest

from agent.protocol import SamplingSpec
from agent.runtime.sampling import Sampling, step_tokens, token_logprobs
from agent.serving.logprobs import step_logprobs


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    out: np.ndarray = z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))
    return out


@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_a_chosen_tokens_logprob_is_the_log_softmax_at_it_and_its_alternatives_are_the_best(top: int) -> None:
    rng = np.random.default_rng(top)
    logits = (rng.normal(size=(4, 3000)) * 4).astype(np.float32)
    toks = [int(rng.integers(3000)) for _ in range(4)]
    chosen, ids, values = token_logprobs(logits, toks, top)
    ref = _log_softmax(logits)
    assert np.allclose(chosen, ref[np.arange(4), toks], atol=1e-9)
    assert ids.shape == values.shape == (4, top)
    for k in range(4):
        assert ids[k].tolist() == np.argsort(-ref[k], kind="stable")[:top].tolist()  # the best, most likely first
        assert np.allclose(values[k], ref[k, ids[k]], atol=1e-9)
        assert np.all(np.diff(values[k]) <= 0)
    assert np.all(chosen <= 0) and np.all(values <= 0)


def test_logprobs_are_the_models_distribution_whatever_chose_the_token() -> None:
    """Greedy or sampled, the reported figure is log softmax(logits) (temperature 1), as OpenAI's."""
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]])).astype(np.float32)
    for s in (Sampling(), Sampling(temperature=0.3, seed=1), Sampling(temperature=1.7, top_p=0.5, seed=2)):
        toks = step_tokens(np.argmax(logits, axis=-1), logits, s, [9])
        chosen, _, _ = token_logprobs(logits, toks, 2)
        assert chosen[0] == pytest.approx(np.log([0.5, 0.3, 0.15, 0.05])[toks[0]], abs=1e-6)


def test_the_greedy_token_leads_its_alternatives_and_ties_go_to_the_lower_id() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 0.5, 3.0]], dtype=np.float32)
    chosen, ids, values = token_logprobs(logits, [1], 3)
    assert ids[0].tolist() == [1, 2, 4]
    assert values[0, 0] == chosen[0] == pytest.approx(values[0, 2])
    _, ids, _ = token_logprobs(logits, [1], 9)  # more than the vocabulary: all of it
    assert ids[0].tolist() == [1, 2, 4, 0, 3]


def test_huge_logits_stay_finite_and_impossible_tokens_are_floored() -> None:
    logits = np.array([[1e4, 1e4 - 1, -np.inf, -3e4]], dtype=np.float32)
    chosen, ids, values = token_logprobs(logits, [2], 4, floor=-9999.0)
    assert chosen[0] == -9999.0
    assert np.all(np.isfinite(values)) and values[0, 0] == pytest.approx(-np.log1p(np.exp(-1.0)))
    assert values[0, -1] == -9999.0 and ids[0, :2].tolist() == [0, 1]


def test_a_step_without_logprobs_asked_gets_none_and_one_that_asks_gets_a_row_a_token() -> None:
    logits = np.random.default_rng(3).normal(size=(3, 50)).astype(np.float32)
    toks = (4, 7, 1)
    assert step_logprobs(logits, toks, SamplingSpec()) is None
    rows = step_logprobs(logits, toks, SamplingSpec(logprobs=2))
    assert rows is not None and len(rows) == 3
    ref = _log_softmax(logits)
    for k, r in enumerate(rows):
        assert r.logprob == pytest.approx(ref[k, toks[k]]) and len(r.top) == 2
        assert r.top[0][0] == int(np.argmax(logits[k]))
