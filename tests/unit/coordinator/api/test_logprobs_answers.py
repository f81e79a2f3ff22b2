"""Generated tokens' log-probabilities as the API answers them: OpenAI's chat shape (token, bytes,
alternatives) and legacy shape (tokens, maps, text offsets), each token sent with the text its own
begins in, none past a stop string; and a token's bytes read from its vocabulary entry."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from agent.protocol import TokenLogprobs
from agent.runtime.tokenizer import BYTE_CHARS, StreamDecoder, piece_bytes, spelling
from coordinator.api.generation import Piece, Tally, tokens
from coordinator.api.logprobs import Scored, chat_logprobs, text_logprobs, token_text
from coordinator.batching.scheduler import GenRequest

# a toy vocabulary: id -> bytes (5 and 6 are the two halves of "é"; 9 ends the answer)
VOCAB = {1: b"Hello", 2: b",", 3: b" wor", 4: b"ld", 5: b"\xc3", 6: b"\xa9", 7: b"!", 8: b" END", 9: b""}


class Toy:
    stop_ids = frozenset({9})

    def decode(self, ids: list[int]) -> str:
        return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)  # type: ignore[arg-type]

    def token_bytes(self, token_id: int) -> bytes:
        return VOCAB[token_id]


def _lp(tok: int) -> TokenLogprobs:
    """A made-up figure a token: its own first among two alternatives."""
    return TokenLogprobs(-0.1 * tok, ((tok, -0.1 * tok), (7, -5.0)))


class Sched:
    """Yields ``out`` as the scheduler does, keeping each token's log-probabilities before it."""

    def __init__(self, out: list[int]) -> None:
        self.out = out
        self.asked: GenRequest | None = None

    async def async_generate(self, req: GenRequest) -> AsyncGenerator[int, None]:
        self.asked = req
        for t in self.out:
            if t in req.stop_ids:
                return
            if req.logprobs is not None:
                req.logprobs.append(_lp(t))
            yield t


def _run(out: list[int], **opts: Any) -> tuple[list[Piece], Sched]:
    sched = Sched(out)
    st: Any = type("St", (), {"tokenizer": Toy(), "scheduler": sched})()
    o = {"max_tokens": 50, "temperature": 0.0, "top_p": 1.0, "seed": 1, "stop": [], "logprobs": 2, **opts}

    async def go() -> list[Piece]:
        return [p async for p in tokens(st, [1], o, Tally("x"))]

    return asyncio.run(go()), sched


def test_every_token_comes_with_its_logprobs_in_the_piece_its_text_begins_in() -> None:
    pieces, sched = _run([1, 2, 3, 4, 5, 6, 7, 9])
    assert sched.asked is not None and sched.asked.sampling.logprobs == 2  # asked of the last stage
    assert "".join(p.text for p in pieces) == "Hello, world\u00e9!"
    scored = [s for p in pieces for s in p.scored]
    assert [s.id for s in scored] == [1, 2, 3, 4, 5, 6, 7]  # every token, the end-of-answer one not
    assert [s.offset for s in scored] == [0, 5, 6, 10, 12, 12, 13]  # the halves of é both begin it
    assert all(s.logprobs == _lp(s.id) for s in scored)
    said = 0
    for p in pieces:  # each token's text had begun by the time it was sent
        said += len(p.text)
        assert all(s.offset < said for s in p.scored)
    assert pieces[-1].finish == "stop"


def test_no_logprobs_when_not_asked() -> None:
    pieces, sched = _run([1, 2, 9], logprobs=None)
    assert sched.asked is not None and sched.asked.sampling.logprobs is None and sched.asked.logprobs is None
    assert all(p.scored == () for p in pieces)


def test_a_stop_string_ends_the_tokens_too() -> None:
    pieces, _ = _run([1, 2, 3, 4, 8, 7], stop=[" wor"])
    assert "".join(p.text for p in pieces) == "Hello,"
    assert [s.id for p in pieces for s in p.scored] == [1, 2]  # " wor" begins the stop string: not sent
    pieces, _ = _run([1, 3, 4, 8], stop=["rld"])
    assert "".join(p.text for p in pieces) == "Hello wo"
    assert [s.id for p in pieces for s in p.scored] == [1, 3]  # " wor" begins before the stop string


def test_the_chat_shape() -> None:
    scored = [Scored(1, _lp(1), 0), Scored(5, TokenLogprobs(-2.0, ((6, -0.5),)), 5)]
    got = chat_logprobs(scored, Toy())
    assert got["refusal"] is None
    assert got["content"][0] == {
        "token": "Hello",
        "logprob": pytest.approx(-0.1),
        "bytes": list(b"Hello"),
        "top_logprobs": [
            {"token": "Hello", "logprob": pytest.approx(-0.1), "bytes": list(b"Hello")},
            {"token": "!", "logprob": -5.0, "bytes": [33]},
        ],
    }
    half = got["content"][1]  # part of a character: its bytes exact, its text as OpenAI writes it
    assert (half["token"], half["bytes"]) == ("bytes:\\xc3", [0xC3])
    assert half["top_logprobs"] == [{"token": "bytes:\\xa9", "logprob": -0.5, "bytes": [0xA9]}]


def test_the_legacy_shape_lists_the_chosen_token_among_its_alternatives() -> None:
    scored = [Scored(1, _lp(1), 0), Scored(2, TokenLogprobs(-3.0, ((7, -0.1),)), 5)]
    got = text_logprobs(scored, Toy())
    assert got["tokens"] == ["Hello", ","]
    assert got["token_logprobs"] == [pytest.approx(-0.1), -3.0]
    assert got["top_logprobs"] == [{"Hello": pytest.approx(-0.1), "!": -5.0}, {"!": -0.1, ",": -3.0}]
    assert got["text_offset"] == [0, 5]
    assert text_logprobs([], Toy()) == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def test_a_tokens_text_and_bytes_from_its_vocabulary_entry() -> None:
    assert len(BYTE_CHARS) == 256 and sorted(BYTE_CHARS.values()) == list(range(256))
    assert piece_bytes("\u0120the", "byte_level") == b" the"  # GPT-2's Ġ is a space
    assert piece_bytes("\u00e2\u0124\u00ac", "byte_level") == "€".encode()
    assert piece_bytes("\u00e2\u0124", "byte_level") == b"\xe2\x82"  # part of a character
    assert piece_bytes("\u2581the", "sentencepiece") == b" the"
    assert piece_bytes("<0xE2>", "sentencepiece") == b"\xe2"
    assert piece_bytes("x\u2603", "byte_level") is None and piece_bytes("x", None) is None
    assert token_text(b"\xe2\x82") == "bytes:\\xe2\\x82" and token_text("€".encode()) == "€"


class _Backend:
    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder

    def to_str(self) -> str:
        return json.dumps({"decoder": self.decoder})


@pytest.mark.parametrize(
    ("decoder", "vocab", "want"),
    [
        ({"type": "ByteLevel", "add_prefix_space": True}, {}, "byte_level"),  # GPT-2, SmolLM2, Qwen2.5
        ({"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}]}, {}, "sentencepiece"),
        ({"type": "Metaspace"}, {}, "sentencepiece"),
        (None, {"<0x00>": 3, "\u2581a": 4}, "sentencepiece"),
        (None, {"a": 1}, None),
    ],
)
def test_how_a_tokenizer_spells_its_tokens(decoder: Any, vocab: dict[str, int], want: str | None) -> None:
    tok = type("Tok", (), {"backend_tokenizer": _Backend(decoder)})()
    assert spelling(tok, vocab) == want
    assert spelling(object(), dict.fromkeys(BYTE_CHARS, 0)) == "byte_level"  # a slow tokenizer: its vocabulary
