"""Keeping what this node offers current: the capacity probe at start, then every second its
token rate, temperature, devices' free memory and the throttle's expiry; re-advertised over mDNS
when it changed noticeably."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from agent.cluster.discovery import MIB, Advert
from agent.throttle.thermal import temperature_c

if TYPE_CHECKING:
    from agent.node.daemon import AgentDaemon

log = logging.getLogger("agent.node.daemon")


async def probe(d: AgentDaemon) -> None:
    from agent.node import capacity

    try:
        cap = await asyncio.to_thread(capacity.probe, requested=d.opts.device)
    except Exception as e:
        log.warning("capacity probe failed: %s", e)
        return
    d.capacity = cap.to_dict()
    d.me.offers = cap.offers()
    d.me.score = cap.speed_score
    d.me.devices = tuple(cap.kinds()) or ("CPU",)
    log.info(
        "capacity: %s",
        ", ".join(f"{o.name} {o.score:.1f} GFLOP/s, {o.mem_free / 2**30:.1f} GB free" for o in d.me.offers)
        or "no device measured",
    )


async def refresh_device_memory(d: AgentDaemon) -> None:
    """Re-read the free memory of devices that have their own (a discrete GPU: a property read on
    the Core the stage runs on); the others offer the system's figure, read fresh for every beat."""
    if not any(o.own_memory for o in d.me.offers):
        return
    from agent.node import capacity
    from agent.runtime.device import core

    def read() -> dict[str, int]:
        c = core()
        return {o.name: capacity.query_memory(c, o.name).free for o in d.me.offers if o.own_memory}

    try:
        free = await asyncio.to_thread(read)
    except Exception as e:
        log.debug("device memory not read: %s", e)
        return
    d.me.offers = tuple(replace(o, mem_free=free.get(o.name, o.mem_free)) for o in d.me.offers)


async def refresh(d: AgentDaemon) -> None:
    """Keep what we offer current; re-advertise over mDNS when it changed noticeably."""
    while True:
        await asyncio.sleep(1.0)
        measure(d)
        await refresh_device_memory(d)
        d.contrib.expire()
        if d.discovery is None:
            continue
        ad, old = d.advert(), d._advertised
        if old is None or differs(old, ad):
            with contextlib.suppress(Exception):
                await d.discovery.async_update()
            d._advertised = ad


def measure(d: AgentDaemon) -> None:
    t0, n0 = d.tokens_seen
    now, n = time.monotonic(), d.host.positions
    d.me.tok_s = round(max(0.0, n - n0) / max(now - t0, 1e-3), 1)
    d.tokens_seen = (now, n)
    d.me.temp_c = temperature_c()
    d.me.next_rtt_ms = None if d.host.next_rtt_ms is None else round(d.host.next_rtt_ms, 3)


def differs(a: Advert, b: Advert) -> bool:
    if (a.state, a.reason, a.devices, round(a.score, 1)) != (b.state, b.reason, b.devices, round(b.score, 1)):
        return True
    return abs(a.mem_free - b.mem_free) > max(256 * MIB, a.mem_free // 10)
