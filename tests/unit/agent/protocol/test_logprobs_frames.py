"""Log-probabilities on the wire: asked for in the sampling settings, answered beside the ids of an
``Ids`` or a ``BatchIds`` as a small payload (never logits), and absent where not asked, so frames
that do not ask are what they always were. A bad count or a bad payload is a clear error."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from agent.protocol import (
    MAX_TOP_LOGPROBS,
    Batch,
    BatchIds,
    Fwd,
    Ids,
    Part,
    ProtocolError,
    SamplingSpec,
    TokenLogprobs,
    decode,
    encode,
)
from agent.protocol.codec import _PREFIX, MAGIC, VERSION
from agent.protocol.logprobs import block_size, pack, unpack

ROWS = (
    TokenLogprobs(-0.25, ((5, -0.25), (9, -1.5), (2, -3.0))),
    TokenLogprobs(-4.0, ((1, -0.5), (5, -1.0), (7, -4.0))),
)


def _raw(h: dict[str, Any], payload: bytes = b"") -> bytes:
    head = msgpack.packb(h, use_bin_type=True)
    return bytes(_PREFIX.pack(MAGIC, VERSION, len(head)) + head + payload)


def test_sampling_asks_for_logprobs_only_when_it_does() -> None:
    assert SamplingSpec(0.5, 0.9, 7).to_list() == [0.5, 0.9, 7]  # as before: an older stage reads it
    assert SamplingSpec(0.5, 0.9, 7, 3).to_list() == [0.5, 0.9, 7, 3]
    for s in (SamplingSpec(), SamplingSpec(logprobs=0), SamplingSpec(1.0, 0.5, 3, MAX_TOP_LOGPROBS)):
        fwd = Fwd(term=1, stream="s", seq=0, n=1, dtype="i32", sampling=s)
        back, _ = decode(encode(fwd, np.zeros(1, np.int32)))
        assert isinstance(back, Fwd) and back.sampling == s
    parts = (Part("a", 0, 2, logits=2, sampling=SamplingSpec(logprobs=5)), Part("b", 0, 1, logits=1))
    back, _ = decode(encode(Batch(term=1, seq=0, dtype="i32", parts=parts), np.zeros(3, np.int32)))
    assert isinstance(back, Batch) and back.parts == parts


@pytest.mark.parametrize("bad", [MAX_TOP_LOGPROBS + 1, -1, 2.0, True, "3"])
def test_a_count_of_alternatives_out_of_bounds_is_refused(bad: Any) -> None:
    h = Fwd(term=1, stream="s", seq=4, n=1, dtype="i32").header()
    h["sampling"] = [0.0, 1.0, 0, bad]
    with pytest.raises(ProtocolError) as e:
        decode(_raw(h, bytes(4)))
    assert e.value.code == "bad_field" and "logprobs" in str(e.value) and (e.value.stream, e.value.seq) == ("s", 4)
    with pytest.raises(ProtocolError, match="logprobs"):
        SamplingSpec.from_list([0.0, 1.0, 0, None, 1])


def test_ids_carry_their_logprobs_as_the_payload_and_none_when_not_asked() -> None:
    ids = Ids(term=2, stream="s", seq=3, tokens=(5, 1), busy_ms=1.5, logprobs=ROWS)
    frame = encode(ids)
    back, payload = decode(frame)
    assert back == ids and isinstance(back, Ids) and back.logprobs == ROWS
    assert len(payload) == block_size(2, 3) == 2 * 4 * 7  # small: 4 bytes a token, 8 an alternative
    assert back.header()["logprobs"] == 3
    plain = Ids(term=2, stream="s", seq=3, tokens=(5, 1))
    assert "logprobs" not in plain.header()  # not asked: the frame as it always was
    back, payload = decode(encode(plain))
    assert back == plain and len(payload) == 0
    only = Ids(term=2, stream="s", seq=3, tokens=(5,), logprobs=(TokenLogprobs(-0.125),))  # 0 alternatives
    assert decode(encode(only))[0] == only


def test_a_batchs_answer_carries_each_asking_streams_logprobs() -> None:
    lp = (ROWS, None, (TokenLogprobs(-1.0, ((3, -0.5),)),))
    ids = BatchIds(term=1, seq=9, streams=("a", "b", "c"), counts=(2, 1, 1), tokens=(5, 1, 8, 3), logprobs=lp)
    back, _ = decode(encode(ids))
    assert isinstance(back, BatchIds) and back == ids
    assert back.logprobs_of() == {"a": ROWS, "c": lp[2]}
    assert back.header()["logprobs"] == [3, None, 1]
    plain = BatchIds(term=1, seq=9, streams=("b",), counts=(1,), tokens=(8,))
    assert "logprobs" not in plain.header() and decode(encode(plain))[0] == plain
    assert plain.logprobs_of() == {}


def test_the_logprobs_are_exact_to_float32() -> None:
    r = (TokenLogprobs(-0.123456789, ((7, -0.123456789), (8, -2.5))),)
    got = unpack(pack(r), 1, 2)[0]
    assert got.logprob == pytest.approx(-0.123456789, abs=1e-7) and got.top[0][0] == 7


def _ids_header(**kw: Any) -> dict[str, Any]:
    h = Ids(term=1, stream="s", seq=2, tokens=(5, 1), logprobs=ROWS).header()
    h.update(kw)
    return h


BAD_BLOCKS = [
    ("short", pack(ROWS)[:-4]),
    ("long", pack(ROWS) + bytes(4)),
    ("positive", pack((TokenLogprobs(0.5, ROWS[0].top), ROWS[1]))),
    ("nan", pack((TokenLogprobs(float("nan"), ROWS[0].top), ROWS[1]))),
    ("unsorted", pack((TokenLogprobs(-0.25, ((5, -1.5), (9, -0.25), (2, -3.0))), ROWS[1]))),
    ("bad id", pack((TokenLogprobs(-0.25, ((-5, -0.25), (9, -1.5), (2, -3.0))), ROWS[1]))),
]


@pytest.mark.parametrize(("what", "block"), BAD_BLOCKS, ids=[w for w, _ in BAD_BLOCKS])
def test_bad_logprobs_are_refused_with_a_clear_error(what: str, block: bytes) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(_raw(_ids_header(), block))
    assert e.value.code == "bad_logprobs" and (e.value.stream, e.value.seq) == ("s", 2)


def test_a_count_over_the_bound_in_an_answer_is_refused() -> None:
    with pytest.raises(ProtocolError, match=f"logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}") as e:
        decode(_raw(_ids_header(logprobs=MAX_TOP_LOGPROBS + 1), bytes(block_size(2, MAX_TOP_LOGPROBS + 1))))
    assert e.value.code == "bad_field"
    with pytest.raises(ProtocolError, match="not both"):
        decode(_raw(_ids_header(rows=2, vocab=3), pack(ROWS)))
    h = BatchIds(term=1, seq=9, streams=("a",), counts=(2,), tokens=(5, 1), logprobs=(ROWS,)).header()
    h["logprobs"] = [MAX_TOP_LOGPROBS + 1]
    with pytest.raises(ProtocolError, match="logprobs"):
        decode(_raw(h, pack(ROWS)))
    h["logprobs"] = [3, 3]  # one entry per stream
    with pytest.raises(ProtocolError, match="one entry per part"):
        decode(_raw(h, pack(ROWS)))
    h["logprobs"] = [3]
    with pytest.raises(ProtocolError, match="bytes after") as e:
        decode(_raw(h, pack(ROWS) + bytes(8)))
    assert e.value.code == "bad_logprobs"


def test_a_message_that_does_not_match_its_tokens_is_not_made() -> None:
    with pytest.raises(ValueError):
        Ids(term=1, stream="s", seq=0, tokens=(1,), logprobs=ROWS)
    with pytest.raises(ValueError):
        BatchIds(term=1, seq=0, streams=("a",), counts=(1,), tokens=(1,), logprobs=(ROWS,))
    with pytest.raises(ValueError):  # a frame of its own payload takes no other
        encode(Ids(term=1, stream="s", seq=0, tokens=(5, 1), logprobs=ROWS), b"xx")
