"""Bad frames sent straight to real agents get errors; the agents keep serving, and a healthy
stream running through the same pipeline at the same time finishes exactly as it would alone."""

from __future__ import annotations

import asyncio
import struct
import threading
from typing import Any

import aiohttp
import msgpack
import numpy as np

from agent.protocol import Error, Fwd, Head, HeadTop, decode, encode
from tests.support.prompts import PROMPTS
from tests.support.served import Served, chat


def _raw(header: dict[str, Any], payload: bytes = b"") -> bytes:
    head = msgpack.packb(header)
    return struct.pack("<2sBI", b"LS", 1, len(head)) + head + payload


async def _attack(node: str, hidden: int, term: int) -> list[tuple[str, str | None]]:
    """Send one bad frame after another to an agent; collect the error codes it answers with."""
    base = {"t": "fwd", "term": term, "stream": "intruder", "seq": 1}
    bad: list[bytes | str] = [
        b"\x00garbage\xff" * 10,
        "a text frame",
        _raw({**base, "n": 2, "dtype": "f16"}, np.zeros((1, 1, hidden), np.float16).tobytes()),  # truncated
        _raw({**base, "n": 1, "dtype": "i64", "start": True}, np.zeros(1, np.int64).tobytes()),  # wrong dtype
        _raw({**base, "n": 10**9, "dtype": "f16"}),  # huge declared size
        _raw({**base, "n": 1, "dtype": "f16"}, np.zeros((1, 1, hidden), np.float16).tobytes()),  # unknown stream
        _raw({**base, "term": term - 1, "n": 1, "dtype": "f16"}),  # stale term
        _raw({**base, "t": "ids", "tokens": [1]}),  # a message agents do not take
        _raw(
            {**base, "n": 1, "dtype": "f16", "start": True, "rollback": 5},
            np.zeros((1, 1, hidden), np.float16).tobytes(),
        ),  # rollback beyond the cache
        _raw({**base, "t": "head", "n": 1}, np.zeros((1, 1, hidden), np.float32).tobytes()),  # head part: none here
        _raw({**base, "t": "head", "n": 0}),  # a head request for no positions
        _raw({**base, "t": "head_top", "values": [1.0], "ids": [1]}),  # an answer nobody asked this agent for
    ]
    codes = []
    async with aiohttp.ClientSession() as s, s.ws_connect(f"http://{node}/ws", max_msg_size=0) as ws:
        for frame in bad:
            if isinstance(frame, str):
                await ws.send_str(frame)
            else:
                await ws.send_bytes(frame)
            msg = await asyncio.wait_for(ws.receive(), 30)
            err, _ = decode(msg.data)
            assert isinstance(err, Error)
            codes.append((err.code, err.stream))
    # A frame above the size limit: the agent drops that connection only.
    async with aiohttp.ClientSession() as s, s.ws_connect(f"http://{node}/ws", max_msg_size=0) as ws:
        try:
            await ws.send_bytes(b"\x00" * (300 * 1024 * 1024))
            msg = await asyncio.wait_for(ws.receive(), 60)
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR)
            assert ws.closed or (await asyncio.wait_for(ws.receive(), 10)).type != aiohttp.WSMsgType.BINARY
        except ConnectionError:
            pass  # the agent closed the connection while the frame (or a pong) was still being sent
    return codes


def test_malformed_frames_get_errors_and_healthy_streams_finish(served3: Served) -> None:
    expected = chat(served3, PROMPTS[2], max_tokens=64, temperature=0)
    got: list[str] = []
    healthy = threading.Thread(target=lambda: got.append(chat(served3, PROMPTS[2], max_tokens=64, temperature=0)))
    healthy.start()
    codes = asyncio.run(_attack(served3.nodes[1], hidden=576, term=1))
    healthy.join(300)
    assert [c for c, _ in codes] == [
        "bad_frame",
        "bad_frame",
        "bad_payload",
        "bad_dtype",
        "bad_field",
        "unknown_stream",
        "stale_term",
        "unexpected",
        "bad_input",
        "no_head_part",
        "bad_field",
        "unexpected",
    ]
    assert got == [expected]
    # and the pipeline still serves new requests afterwards
    assert chat(served3, PROMPTS[2], max_tokens=64, temperature=0) == expected


def test_stage_zero_answers_for_its_rows_of_the_head_and_refuses_bad_requests(served3: Served) -> None:
    async def go() -> list[Any]:
        out = []
        async with aiohttp.ClientSession() as s, s.ws_connect(f"http://{served3.nodes[0]}/ws") as ws:
            hidden = np.random.default_rng(0).standard_normal((1, 2, 576)).astype(np.float32)
            for n, payload in ((2, hidden), (2, hidden[:, :1]), (1, hidden[:, :1].astype(np.float16))):
                await ws.send_bytes(encode(Head(term=1, stream="ask", seq=3, n=n), payload))
                out.append(decode((await asyncio.wait_for(ws.receive(), 30)).data)[0])
        return out

    top, short, half = asyncio.run(go())
    assert isinstance(top, HeadTop) and (top.stream, top.seq) == ("ask", 3)
    assert len(top.ids) == 2 and all(0 <= i < 49152 * 0.4 for i in top.ids)  # stage 0 holds the first 40%
    assert isinstance(short, Error) and short.code == "bad_payload" and short.stream == "ask"
    assert isinstance(half, Error) and half.code == "bad_payload"  # float32 only


def test_stage_zero_refuses_out_of_range_token_ids(served3: Served) -> None:
    async def go() -> Error:
        fwd = Fwd(term=1, stream="evil", seq=0, n=2, dtype="i32", start=True)
        async with aiohttp.ClientSession() as s, s.ws_connect(f"http://{served3.nodes[0]}/ws") as ws:
            await ws.send_bytes(encode(fwd, np.array([[1, 10**8]], dtype=np.int32)))
            err, _ = decode((await asyncio.wait_for(ws.receive(), 30)).data)
            assert isinstance(err, Error)
            return err

    err = asyncio.run(go())
    assert err.code == "bad_input" and "out of range" in err.message and err.stream == "evil"
