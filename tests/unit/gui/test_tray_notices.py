"""Notifications from the event stream's facts (issue 40, item 2): "coordinator lost" only when the
coordinator did not come back (the relay's ``coordinator_lost`` alone, a broken stream, is no
news), with a follow-up once one coordinates; every notice times out, and the follow-up
replaces the loss on screen. Table tests of :class:`gui.state.CoordinatorWatch`, then the tray
driven through its event handler, offscreen."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from agent.protocol.cluster_view import ClusterView, NodeInfo
from agent.protocol.events import CoordinatorLost, Failover, NodeChanged, Snapshot
from gui.notify import Notifier
from gui.state import COORDINATOR, LOST_GRACE_S, NOTICE_MS, CoordinatorWatch, Notice
from gui.tray import TrayApp
from tests.support.fake_backend import FakeBackend
from tests.support.qt import run

CAROL = NodeInfo("carol", "carol-laptop", "10.0.0.3:7700", "coordinator", "available")
BOB = NodeInfo("bob", "bob-laptop", "10.0.0.2:7700", "follower", "available")
ME = NodeInfo("me", "alice-laptop", "10.0.0.1:7700", "follower", "available")


def _snap(at: float, coordinator: str | None, term: int = 3) -> Snapshot:
    return Snapshot(at, ClusterView("office", coordinator, term, nodes=(BOB, CAROL, ME)))


LOST = "The cluster lost its coordinator (carol-laptop); electing another…"
# each step: ("event", event) or ("tick", now, the coordinator the local agent's election names)
Step = tuple[Any, ...]


@pytest.mark.parametrize(
    ("steps", "texts"),
    [
        pytest.param([("event", _snap(1, "carol"))], [], id="the first snapshot is no news"),
        pytest.param(
            [("event", _snap(1, "carol")), ("event", CoordinatorLost(10, "carol")), ("event", _snap(10.5, "carol"))],
            [],
            id="a broken stream, back at once with the same coordinator",
        ),
        pytest.param(
            [
                ("event", _snap(1, "carol")),
                ("event", CoordinatorLost(10, "carol")),
                ("tick", 10 + LOST_GRACE_S + 5, "carol"),
                ("tick", 10 + LOST_GRACE_S + 60, "carol"),
            ],
            [],
            id="the stream stays broken, but the election still names carol: no loss",
        ),
        pytest.param(
            [
                ("event", _snap(1, "carol")),
                ("event", CoordinatorLost(10, "carol")),
                ("tick", 10 + LOST_GRACE_S - 1, None),
                ("tick", 10 + LOST_GRACE_S, None),
                ("tick", 10 + LOST_GRACE_S + 1, None),
                ("event", _snap(20, "bob", 4)),
            ],
            [LOST, "bob-laptop coordinates the cluster now."],
            id="a real loss, told once after the grace, then the follow-up",
        ),
        pytest.param(
            [
                ("event", _snap(1, "carol")),
                ("event", CoordinatorLost(10, "carol")),
                ("tick", 10 + LOST_GRACE_S, None),
                ("event", _snap(20, "carol", 4)),
            ],
            [LOST, "carol-laptop coordinates the cluster again."],
            id="lost, then the same laptop elected again",
        ),
        pytest.param(
            [("event", _snap(1, "carol")), ("event", CoordinatorLost(10, "carol")), ("event", _snap(12, "bob", 4))],
            ["The cluster has a new coordinator: bob-laptop coordinates now (was carol-laptop)."],
            id="a new coordinator within the grace: one notice, no loss",
        ),
        pytest.param(
            [("event", _snap(1, "carol")), ("event", _snap(2, "bob", 4))],
            ["The cluster has a new coordinator: bob-laptop coordinates now (was carol-laptop)."],
            id="a snapshot with another coordinator",
        ),
        pytest.param(
            [("event", _snap(1, "carol")), ("event", Failover(3, "bob", 1.5, 3))],
            ["A laptop left mid-answer (bob-laptop); answers carried on on the others."],
            id="a failover",
        ),
    ],
)
def test_coordinator_notices_follow_the_facts(steps: list[Step], texts: list[str]) -> None:
    w = CoordinatorWatch()
    names = {"carol": "carol-laptop", "bob": "bob-laptop", "me": "alice-laptop"}
    said: list[Notice] = []
    for step in steps:
        if step[0] == "event":
            said += w.on_event(step[1], names, step[1].at)
        else:
            said += w.tick(step[1], step[2], names)
    assert [n.text for n in said] == texts
    for n in said:
        assert 0 < n.timeout_ms <= NOTICE_MS  # none stays on screen
    about = [n for n in said if "coordinat" in n.text]
    assert all(n.key == COORDINATOR for n in about)  # the follow-up replaces the loss on screen


def test_no_coordinator_lost_notice_when_the_coordinator_did_not_change(qloop: asyncio.AbstractEventLoop) -> None:
    """The issue's walkthrough: a balloon said carol was lost while carol coordinated without a break."""
    fake = FakeBackend()  # its /v1/node: the election follows carol
    t = TrayApp(fake)  # type: ignore[arg-type]
    t.notifier = Notifier(t.icon, use_dbus=False)
    run(qloop, t.async_refresh())
    assert t.node is not None and t.node.coordinator == "carol"
    t.on_event(_snap(1, "carol"))
    t.on_event(CoordinatorLost(10, "carol"))  # the relay's stream broke
    for dt in (1, LOST_GRACE_S, LOST_GRACE_S + 30):  # long past the grace: the election still names carol
        t.weigh_coordinator(time.time() + dt)
    t.on_event(_snap(50, "carol"))
    t.on_event(NodeChanged(51, BOB, ("state",)))
    assert t.shown == [] and t.notifier.sent == []

    # a real loss is told, and followed up when bob coordinates
    fake.node_json["coordinator"] = None
    run(qloop, t.async_refresh())
    t.on_event(CoordinatorLost(60, "carol"))
    t.weigh_coordinator(time.time() + LOST_GRACE_S + 1)
    t.on_event(_snap(70, "bob", 4))
    assert [n.text for n in t.shown] == [LOST, "bob-laptop coordinates the cluster now."]
    assert [how for how, _ in t.notifier.sent] == ["none", "none"]  # (offscreen: no tray, no service)
    run(qloop, t.async_stop())
