"""Fuzzing live stages: hostile websocket connections, and a healthy stream beside them.

:class:`Hostile` sends frames to agents' ``/ws`` over its own connections (a fresh one every
``per_conn`` frames, so owned streams are also released by closing). After each frame it sends a
:class:`Ping` with a unique clock value and reads until that :class:`Pong` comes back: the agent
answered everything before it (errors are counted), or closed the connection (counted, and a new
one opened). No Pong within ``timeout`` seconds is a hang. :func:`healthy` runs greedy requests
through an in-process coordinator meanwhile, whose live stream's id the hostile frames aim at
(:func:`name_streams`), and compares each one's tokens with an undisturbed run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from agent.protocol import Error, Ping, Pong, ProtocolError, decode, encode
from coordinator.batching.scheduler import GenRequest
from coordinator.lab.fuzz_frames import VICTIM_MARK
from coordinator.service.coordinator import Coordinator


@dataclass
class Tally:
    sent: int = 0
    errors: int = 0  # Error frames answered
    closes: int = 0  # connections the agent closed
    hangs: int = 0  # frames after which the agent answered nothing within the timeout
    codes: dict[str, int] = field(default_factory=dict)


class Hostile:
    def __init__(
        self,
        urls: list[str],
        ssl_ctx: ssl.SSLContext | None = None,
        per_conn: int = 200,
        timeout: float = 10.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.headers = headers or {}
        self.urls, self.ssl_ctx, self.per_conn, self.timeout = urls, ssl_ctx, per_conn, timeout
        self.tally = Tally()
        self._session: aiohttp.ClientSession | None = None
        self._ws: list[aiohttp.ClientWebSocketResponse | None] = [None] * len(urls)
        self._used = [0] * len(urls)
        self._turn = itertools.cycle(range(len(urls)))
        self._clock = itertools.count(1)
        self.victim: str | None = None  # the healthy stream's id, swapped in for VICTIM_MARK
        self.pending: str | None = None  # the next one, not yet seen on the wire

    async def __aenter__(self) -> Hostile:
        connector = aiohttp.TCPConnector(ssl=self.ssl_ctx) if self.ssl_ctx else None
        self._session = aiohttp.ClientSession(connector=connector)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for ws in self._ws:
            if ws is not None:
                await ws.close()
        if self._session is not None:
            await self._session.close()

    async def _conn(self, i: int) -> aiohttp.ClientWebSocketResponse:
        ws = self._ws[i]
        if ws is None or ws.closed or self._used[i] >= self.per_conn:
            if ws is not None:
                await ws.close()
            assert self._session is not None
            ws = await self._session.ws_connect(self.urls[i], max_msg_size=0, compress=0, headers=self.headers)
            self._ws[i], self._used[i] = ws, 0
        self._used[i] += 1
        return ws

    async def send(self, frame: bytes | str, linger: float = 0.0) -> None:
        """Send one frame to the next agent, and wait until it has answered it (see above);
        ``linger``: then read errors for that much longer (those of the compute thread come later)."""
        i = next(self._turn)
        ws = await self._conn(i)
        if self.victim is not None and isinstance(frame, bytes):
            frame = frame.replace(VICTIM_MARK.encode(), self.victim.encode())
        self.tally.sent += 1
        mark = float(next(self._clock))
        try:
            await (ws.send_str(frame) if isinstance(frame, str) else ws.send_bytes(frame))
            await ws.send_bytes(encode(Ping(sent=mark)))
        except (ConnectionError, RuntimeError):
            self.tally.closes += 1
            return
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    m = await ws.receive()
                    if m.type != aiohttp.WSMsgType.BINARY:
                        self.tally.closes += 1
                        return
                    try:
                        msg, _ = decode(m.data)
                    except ProtocolError:
                        continue
                    if isinstance(msg, Pong) and msg.sent == mark:
                        break
                    self._count(msg)
        except TimeoutError:
            self.tally.hangs += 1
            await ws.close()
            return
        if linger > 0:
            try:
                async with asyncio.timeout(linger):
                    while (m := await ws.receive()).type == aiohttp.WSMsgType.BINARY:
                        with contextlib.suppress(ProtocolError):
                            self._count(decode(m.data)[0])
            except TimeoutError:
                pass

    def reveal(self) -> None:
        """The pending stream's start has reached every stage: from now on frames aim at it.

        An eavesdropper learns a stream's id from its start frame on the wire, as the next stage
        receives it, so it can never name a stream on a stage before the stream's own start is
        there. (A plaintext peer that knew an id earlier could claim it on a stage the start has
        not reached yet: in a loaded run, 0.2 s after the id was made was not always enough,
        and such a claim failed the healthy request; mutual TLS keeps non-members off the links.)"""
        self.victim = self.pending

    def _count(self, msg: object) -> None:
        if isinstance(msg, Error):
            self.tally.errors += 1
            self.tally.codes[msg.code] = self.tally.codes.get(msg.code, 0) + 1


def name_streams(coord: Coordinator, hostile: Hostile) -> None:
    """Tell ``hostile`` each new stream's id (random and unguessable as always, but seen, as an
    eavesdropper on a plaintext LAN would), so that its frames aim at the live stream."""
    assert coord.pipeline is not None
    pipeline = coord.pipeline

    def new_stream() -> str:
        hostile.pending = "victim-" + secrets.token_hex(8)
        return hostile.pending

    pipeline.new_stream = new_stream  # type: ignore[method-assign]


async def generate(
    coord: Coordinator, prompt: list[int], tokens: int, first: Callable[[], None] | None = None
) -> list[int]:
    """A greedy request's tokens; ``first`` is called when its first token is back (its start
    has passed every stage)."""
    assert coord.scheduler is not None
    req = GenRequest(prompt=tuple(prompt), max_tokens=tokens)
    out: list[int] = []
    async for t in coord.scheduler.async_generate(req):
        if not out and first is not None:
            first()
        out.append(t)
    return out


async def healthy(
    coord: Coordinator,
    prompt: list[int],
    tokens: int,
    reference: list[int],
    until: asyncio.Event,
    seen: Callable[[], None] | None = None,
) -> tuple[int, list[str]]:
    """Greedy requests one after another until ``until`` is set (at least one): how many ran, and
    how each run that differed from ``reference`` differed (an exception, or the first token that
    differs), so that a failure says whether the fuzzing reached the stream or the machine's load
    made a request fail. ``seen``: called as each run's first token is back (:meth:`Hostile.reveal`)."""
    differ: list[str] = []
    runs = 0
    while runs == 0 or not until.is_set():
        try:
            got = await generate(coord, prompt, tokens, seen)
        except Exception as e:
            differ.append(f"run {runs}: failed: {type(e).__name__}: {e}")
        else:
            if got != reference:
                at = next(
                    (i for i, (a, b) in enumerate(zip(got, reference, strict=False)) if a != b),
                    min(len(got), len(reference)),
                )
                differ.append(f"run {runs}: {len(got)} tokens, the first difference at token {at}")
        runs += 1
    return runs, differ
