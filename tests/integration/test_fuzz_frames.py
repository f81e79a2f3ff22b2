"""Property-based fuzzing (hypothesis, derandomized: CI sees the same inputs every run) of the
frame decoder and of live stages (issue 26).

The decoder, fed generated headers, raw bytes and mutated valid frames, never raises anything
but :class:`ProtocolError`, and whatever it accepts encodes back to the same message. Live agent
processes (a real 2-stage SmolLM2 ring driven by an in-process coordinator) receive thousands of
hostile frames, many naming the healthy stream's own id, on connections of their own: every
frame is answered (an error, a close, or nothing but the next Pong) within seconds, the agents
never die, and the greedy stream running beside them gives the same tokens as an undisturbed run.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.protocol import Close, Fwd, Head, Message, ProtocolError, decode, encode, tensor
from agent.serving.owners import Owners
from coordinator.lab.fuzz_frames import TYPES, VICTIM_MARK, VICTIMS, join, mutate, valid_frames
from coordinator.lab.live_fuzz import Hostile, generate, healthy, name_streams
from coordinator.lab.local_cluster import LocalCluster
from coordinator.service.coordinator import Coordinator
from tests.support.exact import exact_config

TERM = 1
HIDDEN = 576
FUZZ = settings(
    derandomize=True,
    deadline=timedelta(milliseconds=500),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.sampled_from(["f16", "f32", "i32", "i64", "u8", *VICTIMS, "../x"]),
)
values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=8), c, max_size=6), max_leaves=20
)
FIELDS = ["term", "stream", "seq", "n", "dtype", "start", "rollback", "logits", "sampling", "auto", "stop", "code"]
headers = st.fixed_dictionaries(
    {"t": st.sampled_from(TYPES)}, optional={k: values for k in [*FIELDS, "message", "values", "ids", "tokens"]}
)


def frames_from(data: st.DataObject) -> bytes:
    """One fuzz input: a generated header and payload, mutated valid frames, or raw bytes."""
    kind = data.draw(st.integers(0, 2))
    if kind == 0:
        return join(data.draw(headers), data.draw(st.binary(max_size=64)))
    if kind == 1:
        rng = data.draw(st.randoms(use_true_random=False))
        frame = next(valid_frames(rng, TERM, HIDDEN, data.draw(st.sampled_from([None, *VICTIMS]))))
        for _ in range(data.draw(st.integers(0, 3))):
            frame = mutate(rng, frame)
        return frame
    return data.draw(st.binary(max_size=200))


def check_decoder(frame: bytes) -> Message | None:
    try:
        msg, payload = decode(frame)
    except ProtocolError:
        return None
    for width in (0, HIDDEN):
        if isinstance(msg, Fwd | Head):
            with contextlib.suppress(ProtocolError):
                tensor(msg, payload, width)
    again, _ = decode(encode(msg))
    assert again == msg
    return msg


@settings(FUZZ, max_examples=2000)
@given(st.data())
def test_decoder_raises_only_protocol_errors(data: st.DataObject) -> None:
    check_decoder(frames_from(data))


def test_decoder_edges() -> None:
    assert check_decoder(join({"t": ["fwd"]}, b"")) is None  # an unhashable type name
    assert (
        check_decoder(join({"t": "fwd", "stream": "s", "seq": 0, "n": 10**9, "dtype": "f16", "term": 1}, b"")) is None
    )
    assert check_decoder(join([[[[[[[[]]]]]]]], b"")) is None
    assert check_decoder(b"LS\x01" + (2**32 - 1).to_bytes(4, "little")) is None  # a header bigger than the frame
    deep = b"\x82" + b"".join(msgpack.packb(x) for x in ("t", "fwd", "logits")) + b"\x91" * 5000 + b"\xc0"
    assert check_decoder(b"LS\x01" + len(deep).to_bytes(4, "little") + deep) is None  # nested 5000 deep
    nan = join({"t": "head_top", "term": 1, "stream": "s", "seq": 0, "values": [float("nan")], "ids": [1]}, b"")
    assert check_decoder(nan) is None
    for sha in ("../../../etc", "A" * 64, "0" * 63):
        assign = {"t": "assign", "term": 1, "export_id": "e", "stage": 0, "stages": 1, "manifest_sha256": sha}
        assign |= {"artifacts_url": "http://x", "local_dir": None, "next_hop": "ws://x"}
        with pytest.raises(ProtocolError, match="manifest_sha256"):
            decode(join(assign, b""))


def test_config_file_is_bounded(tmp_path: Any) -> None:
    from agent.common.config import MAX_CONFIG_BYTES, ConfigError, load

    big = tmp_path / "config.yaml"
    big.write_text("# " + "x" * MAX_CONFIG_BYTES)
    with pytest.raises(ConfigError, match="at most"):
        load(big)


class _Conn:
    closed = False


def test_stream_ownership_table() -> None:
    owners, coord, evil, loop = Owners(limit=4), _Conn(), _Conn(), _Conn()
    start = Fwd(term=1, stream="a", seq=0, n=3, dtype="i32", start=True, auto=2)
    owners.admit_fwd(start, coord, False)
    for frame, conn, is_loop in [
        (start, evil, False),  # restart another's stream
        (Fwd(term=1, stream="a", seq=1, n=1, dtype="i32"), evil, False),  # continue it
        (start, loop, True),  # the loop never starts
        (Fwd(term=1, stream="a", seq=5, n=1, dtype="i32", auto=1), loop, True),  # skips a step
        (Fwd(term=1, stream="a", seq=1, n=1, dtype="i32", auto=2), loop, True),  # prolongs
    ]:
        with pytest.raises(ProtocolError, match="another connection"):
            owners.admit_fwd(frame, conn, is_loop)
    owners.admit_fwd(Fwd(term=1, stream="a", seq=1, n=1, dtype="i32", auto=1), loop, True)  # the ring's next step
    with pytest.raises(ProtocolError, match="another connection"):
        owners.admit_end(Close(term=1, stream="a"), evil)
    assert not owners.may_fail("a", evil, False)
    assert owners.admit_end(Close(term=1, stream="b"), evil) is False  # not here: nothing to end
    assert owners.admit_end(Close(term=1, stream="a"), coord) is True
    coord.closed = True  # type: ignore[misc]
    for i in range(4):
        owners.admit_fwd(Fwd(term=1, stream=f"s{i}", seq=0, n=1, dtype="i32", start=True), coord, False)
    owners.admit_fwd(Fwd(term=1, stream="s9", seq=0, n=1, dtype="i32", start=True), evil, False)  # closed ones pruned
    assert owners.release(evil) == ["s9"] and len(owners) == 0


# -- a live ring -----------------------------------------------------------------------------------
class Ring:
    """Two agent processes and a coordinator running on an event loop thread of its own."""

    def __init__(self, smollm2: Any) -> None:
        self.cluster = LocalCluster(2, device="CPU").start()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.coord = Coordinator(exact_config(smollm2, self.cluster.nodes, TERM, max_streams=1))
        self.call(self.coord.async_start())
        self.hostile = self.call(Hostile([f"ws://{n}/ws" for n in self.cluster.nodes]).__aenter__())
        name_streams(self.coord, self.hostile)

    def call(self, coro: Any, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.hostile.__aexit__())
        self.call(self.coord.async_stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.cluster.stop()


@pytest.fixture(scope="module")
def ring(smollm2: Any) -> Iterator[Ring]:
    r = Ring(smollm2)
    yield r
    r.stop()


def test_live_stages_survive_fuzzing_and_a_healthy_stream_is_untouched(ring: Ring, smollm2: Any) -> None:
    prompt = [int(x) for x in np.random.default_rng(3).integers(100, 40000, 24)]
    reference = ring.call(generate(ring.coord, prompt, 32))
    assert len(reference) == 32
    until = asyncio.Event()
    runner = asyncio.run_coroutine_threadsafe(
        healthy(ring.coord, prompt, 32, reference, until, ring.hostile.reveal), ring.loop
    )

    @settings(FUZZ, max_examples=3000, deadline=timedelta(seconds=30))
    @given(st.data())
    def attack(data: st.DataObject) -> None:
        ring.call(ring.hostile.send(frames_from(data)), timeout=60)

    attack()
    ring.loop.call_soon_threadsafe(until.set)
    runs, differ = runner.result(600)
    t = ring.hostile.tally
    print(f"fuzzed {t.sent} frames: {t.errors} errors, {t.closes} closes, {t.hangs} hangs; {runs} healthy runs")
    assert t.sent >= 3000 and t.hangs == 0
    assert t.codes.get("not_owner", 0) > 0  # frames aimed at the healthy stream were refused
    assert all(p.poll() is None for p in ring.cluster.procs)
    assert runs >= 1 and not differ, differ  # each: an exception, or where its tokens differed
    assert ring.call(generate(ring.coord, prompt, 32)) == reference  # and afterwards


def test_frames_from_a_random_seed_are_refused_quickly(ring: Ring) -> None:
    """The bench's own generator (the 100,000-frame run uses it) against the same agents."""
    from coordinator.lab.fuzz_frames import hostile_frames

    frames = hostile_frames(random.Random(7).randrange(1 << 30), TERM, HIDDEN, victim=VICTIM_MARK)
    before = ring.hostile.tally.hangs
    for _ in range(300):
        ring.call(ring.hostile.send(next(frames)), timeout=60)
    assert ring.hostile.tally.hangs == before
