"""The frame codec: typed messages round-trip; every malformed frame is refused with a reason."""

from __future__ import annotations

import struct
from dataclasses import replace

import msgpack
import numpy as np
import pytest

from agent.protocol import (
    Assign,
    Beat,
    Close,
    DeviceOffer,
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

GIB = 1024**3
BEAT = Beat(
    cluster="c",
    node="n1",
    port=7700,
    term=3,
    role="follower",
    leader="n2",
    state="available",
    eligible=True,
    score=300.0,
    mem_free=12 * GIB,
    mem_total=32 * GIB,
    devices=("CPU", "GPU"),
    version="0.1.0",
    offers=(
        DeviceOffer("CPU", 100.0, 12 * GIB, False),
        DeviceOffer("GPU.0", 300.0, 12 * GIB, False),
        DeviceOffer("GPU.1", 900.5, 7 * GIB, True),
    ),
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
        Assign(
            term=2,
            export_id="e",
            stage=0,
            stages=1,
            manifest_sha256="ab" * 32,
            artifacts_url="http://x",
            local_dir="/tmp/s",
            next_hop="ws://y/ws",
            device="GPU.1",
        ),
        BEAT,
        replace(BEAT, offers=()),
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


def test_a_beat_without_offers_still_parses() -> None:
    """An older agent's beat: no offers (its score and mem_free stand for the whole node)."""
    h = {**BEAT.header()}
    del h["offers"]
    msg, _ = decode(_frame(h))
    assert isinstance(msg, Beat) and msg.offers == () and msg.score == 300.0 and msg.mem_free == 12 * GIB
    assert msg == replace(BEAT, offers=())


def test_a_beat_carries_its_offers_as_small_lists() -> None:
    h = BEAT.header()
    assert h["offers"][2] == ["GPU.1", 900.5, 7 * GIB, True]
    assert len(encode(BEAT)) < 600  # one UDP datagram, with room to spare


BEAT_H = BEAT.header()
ASSIGN_H = Assign(
    term=2,
    export_id="e",
    stage=0,
    stages=1,
    manifest_sha256="ab" * 32,
    artifacts_url="http://x",
    local_dir=None,
    next_hop="ws://y/ws",
).header()


@pytest.mark.parametrize(
    "header",
    [
        {**BEAT_H, "offers": "CPU"},
        {**BEAT_H, "offers": {"CPU": 1.0}},
        {**BEAT_H, "offers": [["CPU", 1.0, 1]]},  # too short
        {**BEAT_H, "offers": [["CPU", 1.0, 1, False, "x"]]},  # too long
        {**BEAT_H, "offers": [["CPU", 1.0, 1, False]] * 9},  # more than 8
        {**BEAT_H, "offers": [["cpu", 1.0, 1, False]]},  # device names are upper case
        {**BEAT_H, "offers": [["GPU.123", 1.0, 1, False]]},
        {**BEAT_H, "offers": [["GPU 1", 1.0, 1, False]]},
        {**BEAT_H, "offers": [["", 1.0, 1, False]]},
        {**BEAT_H, "offers": [["A" * 17, 1.0, 1, False]]},
        {**BEAT_H, "offers": [[7, 1.0, 1, False]]},
        {**BEAT_H, "offers": [["CPU", -1.0, 1, False]]},
        {**BEAT_H, "offers": [["CPU", 2e7, 1, False]]},  # above MAX_SCORE
        {**BEAT_H, "offers": [["CPU", "fast", 1, False]]},
        {**BEAT_H, "offers": [["CPU", 1.0, -1, False]]},
        {**BEAT_H, "offers": [["CPU", 1.0, 1 << 51, False]]},  # above MAX_MEM
        {**BEAT_H, "offers": [["CPU", 1.0, 1.5, False]]},
        {**BEAT_H, "offers": [["CPU", 1.0, 1, 1]]},  # own_memory is a bool
        {**BEAT_H, "offers": [["CPU", 1.0, True, False]]},
        {**BEAT_H, "offers": None},
        {**ASSIGN_H, "device": "gpu"},
        {**ASSIGN_H, "device": ""},
        {**ASSIGN_H, "device": "GPU.1.2"},
        {**ASSIGN_H, "device": "CPU; rm -rf /"},
        {**ASSIGN_H, "device": 1},
    ],
)
def test_malformed_offers_and_devices_are_refused(header: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ProtocolError) as e:
        decode(_frame(header))
    assert e.value.code == "bad_field"
