"""The reference answer: the whole model, in one process, the same prompt."""

from __future__ import annotations

from agent.runtime.sampling import Sampling


def reference_answer(whole, tok, prompt: str, max_tokens: int, sampling: Sampling | None = None) -> str:  # type: ignore[no-untyped-def]
    ids = tok.chat_ids([{"role": "user", "content": prompt}])
    g = whole.generate(ids, max_tokens=max_tokens, stop_ids=tok.stop_ids, sampling=sampling)
    return str(tok.decode(g.tokens))
