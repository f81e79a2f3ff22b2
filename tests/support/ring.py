"""Stages assigned by a test itself, as a coordinator assigns them, with the last stage's
answers received on a small websocket server of the test's own: so a test sends exactly the
frames it means to (micro-batches, bad parts) to real agents over real sockets."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import TracebackType

import aiohttp
import numpy as np
from aiohttp import web

from agent.common.hashing import sha256_file
from agent.protocol import Assign, Assigned, Batch, BatchIds, Close, Error, Fwd, Ids, Message, Part, decode, encode
from agent.protocol.data import SamplingSpec
from coordinator.lab.local_cluster import free_port


class Ring:
    """Agents assigned a stage each (of ``export``, on the disk they share, f32 wire, exact
    compile properties) in ``term``; frames go in at stage 0 on ``ws`` (the connection that
    owns the streams it starts), the last stage's answers come back at a return site here."""

    def __init__(self, nodes: list[str], export: Path, term: int) -> None:
        self.nodes, self.export, self.term = nodes, export, term
        self.back: asyncio.Queue[Message] = asyncio.Queue()
        self.ended: list[Error] = []  # errors that came back along the ring
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._control: list[aiohttp.ClientWebSocketResponse] = []

    async def __aenter__(self) -> Ring:
        async def ret(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse(max_msg_size=0)
            await ws.prepare(request)
            async for m in ws:
                if m.type == aiohttp.WSMsgType.BINARY:
                    msg = decode(m.data)[0]
                    if not isinstance(msg, Close):  # (the end of a stream, passed along the ring)
                        self.back.put_nowait(msg)
            return ws

        app = web.Application()
        app.router.add_get("/ws", ret)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self._session = aiohttp.ClientSession()
        for i, node in enumerate(self.nodes):
            ws = await self._session.ws_connect(f"http://{node}/ws", max_msg_size=0)
            self._control.append(ws)
            last = i == len(self.nodes) - 1
            stage_dir = self.export / f"stage_{i}"
            msg = Assign(
                term=self.term,
                export_id="paged-serving-test",
                stage=i,
                stages=len(self.nodes),
                manifest_sha256=sha256_file(stage_dir / "manifest.json"),
                artifacts_url="http://127.0.0.1:1/unused",
                local_dir=str(stage_dir),
                next_hop=f"ws://127.0.0.1:{port}/ws" if last else f"ws://{self.nodes[i + 1]}/ws",
                wire_dtype="f32",
                exact=True,
                loop_hop=f"ws://{self.nodes[0]}/ws" if last else None,
            )
            await ws.send_bytes(encode(msg))
        for ws in self._control:
            got = await self.reply(ws, 300)
            assert isinstance(got, Assigned), got
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        for ws in self._control:
            await ws.close()
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def ws(self) -> aiohttp.ClientWebSocketResponse:
        return self._control[0]

    async def other(self) -> aiohttp.ClientWebSocketResponse:
        """Another connection to stage 0 (someone else's)."""
        assert self._session is not None
        return await self._session.ws_connect(f"http://{self.nodes[0]}/ws", max_msg_size=0)

    @staticmethod
    async def reply(ws: aiohttp.ClientWebSocketResponse, timeout: float = 60) -> Message:
        m = await asyncio.wait_for(ws.receive(), timeout)
        assert m.type == aiohttp.WSMsgType.BINARY, m
        return decode(m.data)[0]

    async def answer(self, timeout: float = 60) -> Message:
        return await asyncio.wait_for(self.back.get(), timeout)

    async def batch(self, seq: int, parts: list[tuple[Part, list[int]]]) -> dict[str, tuple[int, ...]]:
        """Send a micro-batch of (part, its token ids); the tokens the last stage answers."""
        payload = np.asarray([t for _, ids in parts for t in ids], dtype=np.int32)
        await self.ws.send_bytes(
            encode(Batch(term=self.term, seq=seq, dtype="i32", parts=tuple(p for p, _ in parts)), payload)
        )
        got = await self.answer()
        while isinstance(got, Error):  # a stream failed on stage 0: the error went along the ring too
            self.ended.append(got)
            got = await self.answer()
        assert isinstance(got, BatchIds) and got.seq == seq, got
        return got.tokens_of()

    async def alone(self, stream: str, prompt: list[int], sampling: SamplingSpec, tokens: int) -> list[int]:
        """A stream's tokens sent the stateful way: one Fwd frame a step."""
        toks: list[int] = []
        ids, seq = prompt, 0
        while len(toks) < tokens:
            fwd = Fwd(
                term=self.term, stream=stream, seq=seq, n=len(ids), dtype="i32", start=seq == 0, sampling=sampling
            )
            await self.ws.send_bytes(encode(fwd, np.asarray(ids, dtype=np.int32)))
            got = await self.answer()
            assert isinstance(got, Ids) and (got.stream, got.seq) == (stream, seq), got
            toks += got.tokens
            ids, seq = [toks[-1]], seq + 1
        await self.ws.send_bytes(encode(Close(term=self.term, stream=stream)))
        return toks
