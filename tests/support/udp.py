"""Helpers of the election tests on real loopback UDP sockets."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace
from typing import Any

from agent.cluster.elector import Elector
from tests.support.wait import async_wait_until


async def async_start_static(es: list[Elector], also: tuple[tuple[str, int], ...] = ()) -> None:
    """Start each elector on loopback at port 0 (it binds a free port and reads it back), then make
    them each other's static peers (and ``also``'s): no port is picked before it is bound, so no
    other process can take one in between. (Nothing is lost meanwhile: an elector stands only after
    its election delay, and beats only to the peers it knows.)"""
    for e in es:
        assert e.me.port == 0, "give the electors port 0: they take free ports themselves"
        await e.async_start("127.0.0.1")
    peers = tuple(("127.0.0.1", e.me.port) for e in es) + also
    for e in es:
        e.settings = replace(e.settings, port=e.me.port, static_peers=peers)


def agreed(es: list[Elector]) -> str | None:
    leaders = {e.leader() for e in es}
    return leaders.pop() if len(leaders) == 1 and None not in leaders else None


def views(es: list[Elector]) -> dict[str, Any]:
    """What each elector thinks (its role, term and coordinator), for a failure's message."""
    return {e.me.node: (str(e.role), e.store.state.term, e.leader()) for e in es}


async def async_agreement(es: list[Elector], timeout: float = 15.0, *, besides: str | None = None) -> str:
    """Wait until every elector of ``es`` follows one coordinator (another than ``besides``); its node."""
    what = "one coordinator for all" + (f" other than {besides}" if besides else "")
    got = await async_wait_until(
        lambda: agreed(es), timeout, what=what, ok=lambda c: c not in (None, besides), diagnose=lambda: views(es)
    )
    assert got is not None
    return got


async def ask(port: int, frame: bytes, wait: float = 2.0) -> bytes | None:
    """Send one datagram from a fresh socket; the answer, if one comes within ``wait``."""
    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setblocking(False)
    s.bind(("127.0.0.1", 0))
    try:
        await loop.sock_sendto(s, frame, ("127.0.0.1", port))
        return await asyncio.wait_for(loop.sock_recv(s, 65536), wait)
    except TimeoutError:
        return None
    finally:
        s.close()
