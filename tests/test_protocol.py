"""The frame codec: typed messages round-trip; every malformed frame is refused with a reason."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest

from agent.protocol import (
    Assign,
    Close,
    Error,
    Fwd,
    Ids,
    Passed,
    ProtocolError,
    SamplingSpec,
    decode,
    encode,
    tensor,
)


def _frame(header: dict, payload: bytes = b"", magic: bytes = b"LS", version: int = 1) -> bytes:  # type: ignore[type-arg]
    head = msgpack.packb(header)
    return struct.pack("<2sBI", magic, version, len(head)) + head + payload


def test_messages_round_trip() -> None:
    ids = np.array([[1, 2, 3]], dtype=np.int32)
    fwd = Fwd(
        term=3,
        stream="s1",
        seq=7,
        n=3,
        dtype="i32",
        start=True,
        rollback=2,
        logits=(0, 2),
        sampling=SamplingSpec(0.7, 0.9, 42),
        sent_at=12.5,
        busy_ms=31.5,
        ack=True,
    )
    msg, payload = decode(encode(fwd, ids))
    assert msg == fwd
    assert np.array_equal(tensor(msg, payload, 0), ids)  # type: ignore[arg-type]
    for m in (
        Ids(term=1, stream="a", seq=2, tokens=(5, 6), busy_ms=12.25),
        Passed(term=1, stream="a", seq=4),
        Close(term=1, stream="a"),
        Error(code="bad_input", message="no", stream="a", seq=3, stage=1),
        Assign(
            term=2,
            export_id="e",
            stage=1,
            stages=3,
            manifest_sha256="ab" * 32,
            artifacts_url="http://x",
            local_dir=None,
            next_hop="ws://y/ws",
            wire_dtype="f32",
            exact=True,
            link_delay_ms=100.0,
        ),
    ):
        assert decode(encode(m))[0] == m


def test_hidden_state_payload_shape_is_checked() -> None:
    h = np.zeros((1, 2, 8), dtype=np.float16)
    fwd = Fwd(term=1, stream="s", seq=0, n=2, dtype="f16")
    msg, payload = decode(encode(fwd, h))
    assert tensor(msg, payload, 8).shape == (1, 2, 8)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="payload has 32 bytes") as e:
        tensor(msg, payload, 4)  # type: ignore[arg-type]
    assert e.value.code == "bad_payload" and e.value.stream == "s"
    msg, payload = decode(encode(fwd, h[:, :1]))  # truncated tensor
    with pytest.raises(ProtocolError, match="need 32"):
        tensor(msg, payload, 8)  # type: ignore[arg-type]


GOOD = {"t": "fwd", "term": 1, "stream": "s", "seq": 0, "n": 1, "dtype": "i32"}


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"", "bad_frame"),
        (b"\x00\x01garbage", "bad_frame"),
        (b"XX" + b"\x01" + struct.pack("<I", 2) + b"\x80\x80", "bad_frame"),
        (_frame(GOOD, version=9), "bad_version"),
        (b"LS\x01" + struct.pack("<I", 10**9) + b"\x80", "bad_frame"),  # header longer than the frame
        (b"LS\x01" + struct.pack("<I", 3) + b"\xc1\xc1\xc1", "bad_frame"),  # not msgpack
        (_frame([1, 2, 3]), "bad_frame"),  # type: ignore[arg-type]
        (_frame({**GOOD, "t": "launch_missiles"}), "unknown_type"),
        (_frame({**GOOD, "dtype": "f64"}), "bad_dtype"),
        (_frame({**GOOD, "n": 10**9}), "bad_field"),  # absurd declared size
        (_frame({**GOOD, "n": 0}), "bad_field"),
        (_frame({**GOOD, "n": "3"}), "bad_field"),
        (_frame({**GOOD, "term": -1}), "bad_field"),
        (_frame({**GOOD, "stream": ""}), "bad_field"),
        (_frame({**GOOD, "stream": "x" * 1000}), "bad_field"),
        (_frame({**GOOD, "logits": [5]}), "bad_field"),
        (_frame({**GOOD, "sampling": [-1.0, 1.0, 0]}), "bad_field"),
        (_frame({**GOOD, "start": "yes"}), "bad_field"),
        (_frame({**GOOD, "ack": 1}), "bad_field"),
        (_frame({"t": "passed", "term": 1, "stream": "s"}), "bad_field"),  # no seq
        (_frame({**GOOD, "rollback": 1 << 40}), "bad_field"),
        (_frame({**GOOD, "busy_ms": -5.0}), "bad_field"),
        (_frame({**GOOD, "busy_ms": "slow"}), "bad_field"),
    ],
)
def test_malformed_frames_are_refused(frame: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(frame)
    assert e.value.code == code
