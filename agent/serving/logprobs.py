"""A last stage's log-probabilities of the tokens it chose, for the steps whose sampling asks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agent.protocol import SamplingSpec, TokenLogprobs
from agent.protocol.logprobs import LOGPROB_FLOOR, from_arrays
from agent.runtime.sampling import token_logprobs


def step_logprobs(logits: np.ndarray, tokens: Sequence[int], s: SamplingSpec) -> tuple[TokenLogprobs, ...] | None:
    """Each of ``tokens``' log-probabilities (row k of ``logits`` [k, V] chose ``tokens[k]``) with
    ``s.logprobs`` alternatives each; None when the step did not ask."""
    if s.logprobs is None:
        return None
    return from_arrays(*token_logprobs(logits, tokens, s.logprobs, LOGPROB_FLOOR))
