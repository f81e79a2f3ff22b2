"""Publishing the cluster event stream (:mod:`agent.protocol.events`) over websockets.

:class:`EventHub` runs where the cluster is coordinated: it turns the coordinator's view of
the cluster, read every ``interval`` (in process, no network), into events by :func:`diff`,
takes the events that happen in between (streams, failovers) from :meth:`EventHub.publish`,
and fans everything out to subscribers through bounded queues: one that falls behind gets a
fresh snapshot, never an unbounded backlog. :func:`async_serve_events` is the websocket
handler. Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace

from aiohttp import WSMsgType, web

from agent.protocol.cluster_view import ClusterView, NodeInfo
from agent.protocol.events import (
    Event,
    NodeChanged,
    NodeJoined,
    NodeLeft,
    PlanChanged,
    Preparing,
    Snapshot,
    apply_event,
)

log = logging.getLogger(__name__)
QUEUE = 256  # events a subscriber may fall behind before it is sent a snapshot instead
HEARTBEAT_S = 10.0
GIB = 1024**3


def _shown(n: NodeInfo) -> dict[str, object]:
    """What a node map shows of a node, rounded so that noise is not news."""
    return {
        "role": n.role,
        "state": n.state,
        "reason": n.reason,
        "alive": n.alive,
        "devices": n.devices,
        "stage": n.stage,
        "layers": n.layers,
        "address": n.address,
        "name": n.name,
        "mem_free": round(n.mem_free / (GIB / 4)),  # quarter GB
        "score": round(n.score, -1),
        "temp_c": None if n.temp_c is None else round(n.temp_c),
        "tok_s": 0 if n.tok_s < 0.5 else max(1, round(n.tok_s, -1 if n.tok_s >= 20 else 0)),
        "rtt_ms": _doubling(n.rtt_ms),
        "next_rtt_ms": _doubling(n.next_rtt_ms),
    }


def _doubling(ms: float | None) -> int | None:
    """A round trip, in steps that double (so that jitter is not news)."""
    return None if ms is None else round(math.log2(max(ms, 0.25)))


def diff(old: ClusterView | None, new: ClusterView, at: float) -> list[Event]:
    """The events that take a reader from ``old`` to ``new`` (pure).

    A new coordinator or term is a new snapshot; otherwise nodes that appeared, disappeared
    or changed what a node map shows, a moved plan, and the preparation's progress.
    """
    if old is None or (old.coordinator, old.term, old.cluster) != (new.coordinator, new.term, new.cluster):
        return [Snapshot(at, new)]
    out: list[Event] = []
    before = {n.node: n for n in old.nodes}
    after = {n.node: n for n in new.nodes}
    for node, n in after.items():
        o = before.get(node)
        if o is None:
            out.append(NodeJoined(at, n))
            continue
        a, b = _shown(o), _shown(n)
        changed = tuple(k for k in b if a[k] != b[k])
        if changed:
            out.append(NodeChanged(at, n, changed))
    for node, o in before.items():
        if node not in after:
            out.append(NodeLeft(at, node, o.name))
    plan_old = (old.ring, tuple(_layers_of(old)), old.model, old.service)
    plan_new = (new.ring, tuple(_layers_of(new)), new.model, new.service)
    if plan_old != plan_new:
        out.append(PlanChanged(at, new.ring, tuple(_layers_of(new)), new.model, new.service, new.term))
    if old.preparing != new.preparing:  # (steps are published as they happen; this brings their percent)
        out.append(Preparing(at, new.preparing))
    return out


def _layers_of(v: ClusterView) -> list[tuple[int, int]]:
    by = {n.node: n.layers for n in v.nodes}
    return [by.get(r) or (0, 1) for r in v.ring]


class HubClosed(Exception):
    """The hub stopped (its node no longer coordinates): readers must find the new one."""


class Subscription:
    def __init__(self, hub: EventHub) -> None:
        self.hub = hub
        self.queue: asyncio.Queue[Event] = asyncio.Queue(QUEUE)
        self.resyncs = 0
        self.closed = asyncio.Event()

    def offer(self, ev: Event) -> None:
        try:
            self.queue.put_nowait(ev)
        except asyncio.QueueFull:
            while not self.queue.empty():
                self.queue.get_nowait()
            self.resyncs += 1
            view = self.hub.current
            if view is not None:
                self.queue.put_nowait(Snapshot(time.time(), view))

    async def get(self) -> Event:
        """The next event; raises HubClosed once the hub has stopped."""
        if self.closed.is_set() and self.queue.empty():
            raise HubClosed()
        getter = asyncio.ensure_future(self.queue.get())
        ended = asyncio.ensure_future(self.closed.wait())
        try:
            await asyncio.wait({getter, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
        raise HubClosed()

    def close(self) -> None:
        self.hub.subscribers.discard(self)
        self.closed.set()


class EventHub:
    """The coordinator's event source: diffs of ``view()`` plus what is published."""

    def __init__(self, view: Callable[[], ClusterView], interval: float = 0.25) -> None:
        self.view = view
        self.interval = interval
        self.current: ClusterView | None = None
        self.subscribers: set[Subscription] = set()
        self.published = 0
        self._task: asyncio.Task[None] | None = None

    async def async_start(self) -> None:
        """Read the view now, and every ``interval`` from now on (until :meth:`async_stop`)."""
        if self._task is None:
            self.refresh()
            self._task = asyncio.create_task(self._run())

    async def async_stop(self) -> None:
        """Stop, and end every subscription (their readers then look for the next coordinator)."""
        for s in list(self.subscribers):
            s.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.refresh()
            except Exception:
                log.exception("cluster view failed")

    def refresh(self) -> None:
        """Compare the coordinator's view now with the last one; publish the differences."""
        new = self.view()
        events = diff(self.current, new, time.time())
        # the counts come from the view itself: stream events between two reads only adjust them
        self.current = new
        for ev in events:
            self._fan_out(ev)

    def publish(self, ev: Event) -> None:
        """An event the view does not show (a stream started or finished, a failover)."""
        if self.current is not None:
            self.current = apply_event(self.current, ev) or self.current
        self._fan_out(ev)

    def _fan_out(self, ev: Event) -> None:
        self.published += 1
        for s in list(self.subscribers):
            s.offer(ev)

    def subscribe(self) -> Subscription:
        s = Subscription(self)
        if self.current is None:
            self.refresh()
        assert self.current is not None
        s.offer(Snapshot(time.time(), replace(self.current)))
        self.subscribers.add(s)
        return s


async def async_serve_events(request: web.Request, hub: EventHub) -> web.WebSocketResponse:
    """The ``/v1/cluster/events`` websocket: a snapshot, then events until either side leaves."""
    ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=64 * 1024)
    await ws.prepare(request)
    sub = hub.subscribe()

    async def drain_incoming() -> None:
        async for m in ws:  # readers send nothing; reading notices a close
            if m.type in (WSMsgType.ERROR, WSMsgType.CLOSE):
                break

    reader = asyncio.create_task(drain_incoming())
    try:
        while not ws.closed:
            getter = asyncio.ensure_future(sub.get())
            done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                break
            await ws.send_str(getter.result().to_json())
    except (ConnectionError, RuntimeError, HubClosed):
        pass
    finally:
        sub.close()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
        await ws.close()
    return ws
