"""The cluster event stream: its messages, the diff that makes them, the hub that fans them out."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from agent.api.events import QUEUE, EventHub, diff
from agent.protocol.cluster_view import ClusterView, NodeInfo
from agent.protocol.codec import ProtocolError
from agent.protocol.events import (
    CoordinatorLost,
    Failover,
    NodeChanged,
    NodeJoined,
    NodeLeft,
    PlanChanged,
    Snapshot,
    StreamFinished,
    StreamStarted,
    Takeover,
    apply_event,
    parse_event,
)

A = NodeInfo("aaa", "laptop-a", "10.0.0.1:7700", "coordinator", "available", mem_free=8 << 30, mem_total=16 << 30)
B = NodeInfo("bbb", "laptop-b", "10.0.0.2:7700", "follower", "available", mem_free=4 << 30, mem_total=16 << 30)
C = NodeInfo("ccc", "laptop-c", "10.0.0.3:7700", "follower", "available", mem_free=4 << 30, mem_total=16 << 30)
V = ClusterView("office", "aaa", 3, "smollm2-135m", "serving", nodes=(A, B))


def test_every_event_survives_the_wire() -> None:
    staged = replace(V, ring=("aaa", "bbb"), nodes=(replace(A, stage=0, layers=(0, 17)), replace(B, layers=(17, 30))))
    events = [
        Snapshot(1.0, staged),
        NodeJoined(2.0, C),
        NodeChanged(3.0, replace(B, state="paused", reason="user"), ("state", "reason")),
        NodeLeft(4.0, "bbb", "laptop-b"),
        PlanChanged(5.0, ("aaa", "ccc"), ((0, 20), (20, 30)), "smollm2-135m", "re-planning", 4),
        Failover(6.0, "bbb", 2.5, 5),
        Takeover(6.5, "ccc", 6, 1, 1, 1.2, False),
        CoordinatorLost(7.0, "aaa"),
        StreamStarted(8.0, "chatcmpl-1", 32, 64),
        StreamFinished(9.0, "chatcmpl-1", 64, 3.2, 0.25, 21.5, "cancelled", ("aaa", "bbb")),
    ]
    for ev in events:
        assert parse_event(ev.to_json()) == ev


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("not json", "bad_frame"),
        ("[1, 2]", "bad_frame"),
        ('{"type": "reboot", "at": 1}', "unknown_type"),
        ('{"type": "node_left", "at": 1, "node": "../etc"}', "bad_field"),
        ('{"type": "takeover", "at": 1, "coordinator": "c", "exported": "no"}', "bad_field"),
        ('{"type": "takeover", "at": 1, "coordinator": "c", "moved": -1}', "bad_field"),
        ('{"type": "node_left", "at": "noon", "node": "a"}', "bad_field"),
        ('{"type": "stream_finished", "at": 1, "stream": "s", "outcome": "exploded"}', "bad_field"),
        ('{"type": "plan_changed", "at": 1, "ring": ["a", "b"], "layers": [[0, 5]]}', "bad_field"),
        ('{"type": "plan_changed", "at": 1, "ring": ["a"], "layers": [[5, 5]]}', "bad_field"),
        ('{"type": "snapshot", "at": 1, "view": {"cluster": "x", "term": -1}}', "bad_field"),
        (
            '{"type": "node_joined", "at": 1, "node": {"node": "a", "name": "a", "address": "a", "role": "king"}}',
            "bad_field",
        ),
        ("x" * (5 * 1024 * 1024), "too_large"),
    ],
)
def test_malformed_events_are_refused_with_a_reason(text: str, code: str) -> None:
    with pytest.raises(ProtocolError) as e:
        parse_event(text)
    assert e.value.code == code


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (None, V, ["snapshot"]),
        (V, V, []),
        (V, replace(V, term=4), ["snapshot"]),  # a new term: start over
        (V, replace(V, coordinator="bbb"), ["snapshot"]),
        (V, replace(V, nodes=(A, B, C)), ["node_joined"]),
        (V, replace(V, nodes=(A,)), ["node_left"]),
        (V, replace(V, nodes=(A, replace(B, state="paused", reason="user"))), ["node_changed"]),
        # noise is not news: a few MB of memory, a round trip that did not double, a tenth of a token/s
        (V, replace(V, nodes=(A, replace(B, mem_free=B.mem_free + (30 << 20)))), []),
        (replace(V, nodes=(A, replace(B, rtt_ms=0.9))), replace(V, nodes=(A, replace(B, rtt_ms=1.1))), []),
        (
            replace(V, nodes=(A, replace(B, rtt_ms=1.0))),
            replace(V, nodes=(A, replace(B, rtt_ms=9.0))),
            ["node_changed"],
        ),
        (replace(V, nodes=(A, replace(B, tok_s=30.1))), replace(V, nodes=(A, replace(B, tok_s=30.3))), []),
        (V, replace(V, nodes=(A, replace(B, temp_c=91.0))), ["node_changed"]),
        (
            V,
            replace(
                V,
                ring=("aaa", "bbb"),
                nodes=(replace(A, stage=0, layers=(0, 17)), replace(B, stage=1, layers=(17, 30))),
            ),
            ["node_changed", "node_changed", "plan_changed"],
        ),
        (V, replace(V, service="re-planning"), ["plan_changed"]),
    ],
)
def test_the_diff_says_what_a_node_map_would_show_differently(
    old: ClusterView | None, new: ClusterView, expected: list[str]
) -> None:
    assert [e.TYPE for e in diff(old, new, 1.0)] == expected


def test_applying_the_diff_gives_the_new_view() -> None:
    """What a reader rebuilds from the events equals what the coordinator sees (nodes and plan)."""
    steps = [
        V,
        replace(V, nodes=(A, B, C)),
        replace(
            V, ring=("aaa", "ccc"), nodes=(replace(A, stage=0, layers=(0, 20)), B, replace(C, stage=1, layers=(20, 30)))
        ),
        replace(
            V, ring=("aaa",), nodes=(replace(A, stage=0, layers=(0, 30)), replace(C, state="paused", reason="92 C"))
        ),
    ]
    seen: ClusterView | None = None
    prev: ClusterView | None = None
    for v in steps:
        for ev in diff(prev, v, 1.0):
            seen = apply_event(seen, ev)
        prev = v
        assert seen is not None
        assert {n.node: (n.state, n.reason, n.stage, n.layers) for n in seen.nodes} == {
            n.node: (n.state, n.reason, n.stage, n.layers) for n in v.nodes
        }
        assert seen.ring == v.ring


def test_streams_are_counted_between_two_reads() -> None:
    v = apply_event(V, StreamStarted(1.0, "s1", 10, 20))
    assert v is not None and v.streams == 1
    v = apply_event(v, StreamFinished(2.0, "s1", 20, 1.0, 0.1, 20.0, "done", ("aaa",)))
    assert v is not None and v.streams == 0
    assert apply_event(V, CoordinatorLost(3.0, "aaa")) == replace(V, coordinator=None, service="idle")
    assert apply_event(None, NodeLeft(1.0, "aaa", "")) is None  # nothing before the first snapshot


async def test_a_subscriber_that_falls_behind_gets_a_snapshot_not_a_backlog() -> None:
    view = V
    hub = EventHub(lambda: view, interval=0.01)
    await hub.async_start()
    try:
        fast, slow = hub.subscribe(), hub.subscribe()
        assert isinstance(await fast.get(), Snapshot)
        for i in range(QUEUE + 50):
            hub.publish(StreamStarted(float(i), f"s{i}", 1, 1))
            if not fast.queue.empty():
                await fast.get()
        assert slow.resyncs >= 1 and slow.queue.qsize() < QUEUE
        first = await slow.get()
        assert isinstance(first, Snapshot)
        # the view moved: subscribers hear about it through the refresh loop
        view = replace(V, nodes=(A, B, C))
        ev = None
        for _ in range(200):
            ev = await asyncio.wait_for(fast.get(), 2.0)
            if isinstance(ev, NodeJoined):
                break
        assert isinstance(ev, NodeJoined) and ev.node == C
        slow.close()
        assert slow not in hub.subscribers
    finally:
        await hub.async_stop()


def test_events_are_plain_json_objects_with_a_type() -> None:
    d = json.loads(NodeLeft(1.0, "bbb", "laptop-b").to_json())
    assert d == {"type": "node_left", "at": 1.0, "node": "bbb", "name": "laptop-b"}


async def test_a_stopped_hub_ends_its_subscriptions() -> None:
    """A coordinator that steps down ends its readers' streams, so that relays find the new one."""
    from agent.api.events import HubClosed

    hub = EventHub(lambda: V, interval=0.01)
    await hub.async_start()
    sub = hub.subscribe()
    assert isinstance(await sub.get(), Snapshot)
    waiting = asyncio.ensure_future(sub.get())
    await asyncio.sleep(0)  # one turn of the loop: the reader runs into its wait (get() blocks at its first await)
    assert not waiting.done()
    await hub.async_stop()
    with pytest.raises(HubClosed):
        await asyncio.wait_for(waiting, 1.0)
    assert not hub.subscribers


def test_link_probes_round_trip_and_are_checked() -> None:
    from agent.protocol import Ping, Pong, decode, encode

    assert decode(encode(Ping(sent=12.5)))[0] == Ping(12.5)
    assert decode(encode(Pong(sent=12.5)))[0] == Pong(12.5)
    with pytest.raises(ProtocolError):
        decode(encode(Ping(sent=-1.0)))
