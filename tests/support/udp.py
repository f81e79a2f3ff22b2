"""Helpers of the election tests on real loopback UDP sockets."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from agent.cluster.elector import Elector


async def until(cond: Callable[[], bool], timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.05)


def agreed(es: list[Elector]) -> str | None:
    leaders = {e.leader() for e in es}
    return leaders.pop() if len(leaders) == 1 and None not in leaders else None


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
