"""Generated tokens' log-probabilities in OpenAI's two shapes: a chat completion's
(``choices[].logprobs.content[]``: each token with its bytes and its most likely alternatives) and
a legacy text completion's (``tokens``, ``token_logprobs``, ``top_logprobs`` as one map a token,
``text_offset``).

A token's text is its bytes read as UTF-8; a token that holds only part of a character is written
``bytes:\\xe2\\x80`` as OpenAI writes it (its ``bytes`` are exact either way). A legacy
completion's ``text_offset`` counts characters from the start of the generated text, and each
token's map lists its alternatives and the chosen token itself (OpenAI's "up to logprobs + 1").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agent.protocol import TokenLogprobs


class TokenBytes(Protocol):
    """What spells a token (the tokenizer)."""

    def token_bytes(self, token_id: int) -> bytes: ...


@dataclass(frozen=True)
class Scored:
    """A generated token with its log-probabilities, and where its text begins in the answer's text
    (characters)."""

    id: int
    logprobs: TokenLogprobs
    offset: int


def token_text(b: bytes) -> str:
    """A token's text as OpenAI writes it: its bytes as UTF-8, or ``bytes:\\x..`` for part of a character."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def _entry(tok: TokenBytes, token_id: int, logprob: float) -> dict[str, Any]:
    b = tok.token_bytes(token_id)
    return {"token": token_text(b), "logprob": logprob, "bytes": list(b)}


def chat_logprobs(scored: Sequence[Scored], tok: TokenBytes) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs``: one entry a token, each with its alternatives."""
    content = [
        {
            **_entry(tok, s.id, s.logprobs.logprob),
            "top_logprobs": [_entry(tok, i, v) for i, v in s.logprobs.top],
        }
        for s in scored
    ]
    return {"content": content, "refusal": None}


def text_logprobs(scored: Sequence[Scored], tok: TokenBytes) -> dict[str, Any]:
    """A legacy completion's ``logprobs``: the tokens, their log-probabilities, a map a token of its
    alternatives and itself (text to log-probability; of two alike texts the likelier), and where
    each token's text begins."""
    tops = []
    for s in scored:
        alts: dict[str, float] = {}
        for i, v in (*s.logprobs.top, (s.id, s.logprobs.logprob)):
            alts.setdefault(token_text(tok.token_bytes(i)), v)
        tops.append(alts)
    return {
        "tokens": [token_text(tok.token_bytes(s.id)) for s in scored],
        "token_logprobs": [s.logprobs.logprob for s in scored],
        "top_logprobs": tops,
        "text_offset": [s.offset for s in scored],
    }
