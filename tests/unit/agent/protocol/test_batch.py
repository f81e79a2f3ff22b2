"""Micro-batch frames: what a paged stage reads, and what it refuses with a clear error."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from agent.protocol import Batch, BatchIds, Part, ProtocolError, SamplingSpec, batch_rows, decode, encode
from agent.protocol.batch import MAX_PARTS
from agent.protocol.codec import _PREFIX, MAGIC, VERSION

PARTS = (
    Part("a", seq=0, n=5, start=True),  # a prompt chunk, no token wanted yet
    Part("b", seq=7, n=1, logits=1),  # a decode step
    Part("c", seq=3, n=4, rollback=2, logits=4, sampling=SamplingSpec(0.7, 0.9, 42)),  # a verify of K=3
)


def _raw(h: dict[str, Any], payload: bytes = b"") -> bytes:
    head = msgpack.packb(h, use_bin_type=True)
    return bytes(_PREFIX.pack(MAGIC, VERSION, len(head)) + head + payload)


def test_a_batch_round_trips_with_its_rows() -> None:
    ids = np.arange(10, dtype=np.int32)
    msg, payload = decode(encode(Batch(term=3, seq=11, dtype="i32", parts=PARTS, sent_at=1.5), ids))
    assert isinstance(msg, Batch) and msg.parts == PARTS and msg.rows == 10
    assert msg.spans() == [(0, 5), (5, 6), (6, 10)]
    assert batch_rows(msg, payload, 0).tolist() == list(range(10))
    hidden = np.ones((10, 8), np.float16)
    msg, payload = decode(encode(Batch(term=3, seq=11, dtype="f16", parts=PARTS), hidden))
    assert isinstance(msg, Batch) and batch_rows(msg, payload, 8).shape == (10, 8)


FORKS = (
    Part("d", seq=0, n=3, start=True, logits=1, fork="a", fork_len=64),  # shares a's first 64 positions
    Part("b", seq=8, n=1, logits=1),
)


def test_a_fork_round_trips_and_frames_without_forks_carry_no_fork_columns() -> None:
    msg, _ = decode(encode(Batch(term=3, seq=12, dtype="i32", parts=FORKS), np.arange(4, dtype=np.int32)))
    assert isinstance(msg, Batch) and msg.parts == FORKS
    h = msg.header()
    assert (h["fork"], h["fork_len"]) == (["a", None], [64, 0])
    today = {"t", "term", "seq", "dtype", "sent_at", "busy_ms", "streams", "seqs", "n", "start", "rollback"}
    today |= {"logits", "sampling"}
    assert set(Batch(term=3, seq=12, dtype="i32", parts=PARTS).header()) == today  # no fork: frames as before


def test_ids_round_trip_and_split_by_stream() -> None:
    ids = BatchIds(term=3, seq=11, streams=("b", "c"), counts=(1, 4), tokens=(9, 1, 2, 3, 4), busy_ms=2.5)
    back, _ = decode(encode(ids))
    assert back == ids and back.tokens_of() == {"b": (9,), "c": (1, 2, 3, 4)}


GOOD: dict[str, Any] = Batch(term=1, seq=0, dtype="i32", parts=PARTS).header()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"n": [5, 1]}, "one entry per part"),  # lengths that do not add up to the parts
        ({"streams": []}, "1 to"),
        ({"streams": [f"s{i}" for i in range(MAX_PARTS + 1)]}, "1 to"),
        ({"streams": ["a", "a", "c"]}, "twice"),
        ({"n": [5, 0, 4]}, "n must"),  # a part with no rows
        ({"logits": [0, 2, 4]}, "logits must"),  # more tokens than rows
        ({"n": [20000, 1, 20000]}, "at most"),  # over the frame's token cap
        ({"start": [1, 0, 0]}, "true or false"),
        ({"rollback": [0, -1, 0]}, "rollback must"),
        ({"sampling": [[0.0, 1.0, 0], [0.0, 1.0], [0.0, 1.0, 0]]}, "sampling must"),
        ({"dtype": "u8"}, "dtype must"),
        ({"seqs": None}, "one entry per part"),
    ],
)
def test_inconsistent_batches_are_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(_raw({**GOOD, **change}))


FORKED: dict[str, Any] = Batch(term=1, seq=0, dtype="i32", parts=FORKS).header()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"fork_len": [0, 0]}, "fork_len 0 iff no fork"),  # a fork sharing nothing
        ({"fork": None}, "fork_len 0 iff no fork"),  # positions shared from no stream
        ({"fork": [None, None]}, "fork_len 0 iff no fork"),
        ({"fork": ["a", "a"], "fork_len": [64, 32]}, "only a starting part"),  # b does not start
        ({"fork": ["d", None]}, "cannot fork itself"),
        ({"rollback": [2, 0]}, "no rollback"),
        ({"fork": ["a"]}, "one entry per part"),
        ({"fork": [7, None]}, "fork must"),
        ({"fork": ["x" * 200, None]}, "fork must"),
        ({"fork_len": [-32, 0]}, "fork_len must"),
        ({"fork_len": [1 << 21, 0]}, "fork_len must"),
    ],
)
def test_inconsistent_forks_are_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(_raw({**FORKED, **change}))


def test_a_payload_that_does_not_match_the_rows_is_refused() -> None:
    msg, payload = decode(encode(Batch(term=1, seq=0, dtype="i32", parts=PARTS), np.zeros(9, np.int32)))
    assert isinstance(msg, Batch)
    with pytest.raises(ProtocolError, match="10 rows of i32 need 40") as e:
        batch_rows(msg, payload, 0)
    assert e.value.code == "bad_payload"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"counts": [1]}, "one entry per part"),
        ({"tokens": [9, 1, 2]}, "add up"),
        ({"tokens": [9, 1, 2, 3, -4]}, "token must"),
    ],
)
def test_inconsistent_ids_are_refused(change: dict[str, Any], match: str) -> None:
    good = BatchIds(term=1, seq=0, streams=("b", "c"), counts=(1, 4), tokens=(9, 1, 2, 3, 4)).header()
    with pytest.raises(ProtocolError, match=match):
        decode(_raw({**good, **change}))
