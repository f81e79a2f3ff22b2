"""The contribution controller's answers to its user (issue 40, item 1): Resume while the user is
at the keyboard contributes at once, limited (not still "paused: user active"), until they leave
the laptop; a changed throttle setting ("Contribute while I work": ``while_in_use: limit``)
applies at once, with no dwell; ``/v1/node`` tells the tray the policy it runs with."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from agent.protocol.status import NodeStatus, PauseReason, ThrottlePolicy
from agent.throttle.controller import Contribution
from agent.throttle.policy import AVAILABLE, LIMITED, PAUSED, Clock, ThrottleSettings
from agent.throttle.readings import Readings

NOON = Clock(2, 12 * 60)
AWAY = Readings(idle_s=3600.0, temp_c=50.0, on_battery=False)
TYPING = replace(AWAY, idle_s=3.0)


@dataclass
class Me:
    state: str = AVAILABLE
    reason: str | None = None
    reason_kind: str | None = None


class Stage:
    def __init__(self) -> None:
        self.calls: list[tuple[str | None, float | None]] = []

    def __call__(self, paused: str | None, share: float | None) -> None:
        self.calls.append((paused, share))


def _contribution(s: ThrottleSettings) -> tuple[Contribution, Me, list[ThrottleSettings]]:
    holder = [s]  # the daemon's settings: a save replaces them
    me = Me()
    c = Contribution(me, Stage(), lambda: holder[0])
    c._lower_priority = lambda: None  # type: ignore[method-assign]  # (not this test process's priority)
    c._restore_priority = lambda: None  # type: ignore[method-assign]
    return c, me, holder


@pytest.mark.parametrize(
    ("switch", "readings", "state", "reason", "kind"),
    [
        (None, TYPING, PAUSED, "user active", "input"),  # the policy: paused while in use
        ("available", TYPING, LIMITED, "user active", "input"),  # resumed while typing: limited, at once
        ("available", AWAY, AVAILABLE, None, None),
        ("paused", AWAY, PAUSED, "user", "switch"),
        ("paused", TYPING, PAUSED, "user", "switch"),  # the user's own switch wins a tie
    ],
)
def test_the_switch_and_the_policy(
    switch: str | None, readings: Readings, state: str, reason: str | None, kind: str | None
) -> None:
    c, me, _ = _contribution(ThrottleSettings())
    c.observe(readings, 1000.0, NOON)
    if switch is not None:
        c.set_manual(switch, now=1001.0)
    assert (me.state, me.reason, me.reason_kind) == (state, reason, kind)


def test_resume_while_typing_limits_at_once_until_the_user_leaves() -> None:
    c, me, _ = _contribution(ThrottleSettings(idle_minutes=2.0, min_dwell_s=10.0))
    c.observe(TYPING, 1000.0, NOON)
    c.set_manual("paused", now=1000.0)  # "Pause contributing", then "Resume" a second later, still typing
    c.observe(TYPING, 1001.0, NOON)
    c.set_manual("available", now=1001.0)
    assert (me.state, me.reason) == (LIMITED, "user active")  # not the stale "paused: user active"
    assert c.input_waived and c.status()["input_waived"] is True
    c.observe(TYPING, 1002.0, NOON)
    assert me.state == LIMITED  # while they type on
    c.observe(replace(AWAY, idle_s=121.0), 1200.0, NOON)  # they left it: the waiver ends
    assert me.state == AVAILABLE and not c.input_waived
    c.observe(TYPING, 1300.0, NOON)  # back at the keyboard: the policy as set
    assert (me.state, me.reason) == (PAUSED, "user active")


def test_a_timed_pause_that_ends_while_typing_pauses_as_the_policy_says() -> None:
    c, me, _ = _contribution(ThrottleSettings())
    c.observe(TYPING, 1000.0, NOON)
    c.set_manual("paused", 60.0, now=1000.0)
    assert c.manual_until is not None
    c.expire(c.manual_until + 1)  # nobody resumed it: no waiver
    assert (me.state, me.reason, c.input_waived) == (PAUSED, "user active", False)


def test_contribute_while_i_work_applies_at_once() -> None:
    c, me, holder = _contribution(ThrottleSettings(min_dwell_s=10.0))
    c.observe(TYPING, 1000.0, NOON)
    assert me.state == PAUSED
    holder[0] = replace(holder[0], while_in_use="limit")  # the tray's toggle, saved in the settings
    c.reconsider(1000.5)  # (the daemon's apply_settings): within the dwell, yet at once
    assert (me.state, me.reason, me.reason_kind) == (LIMITED, "user active", "input")
    holder[0] = replace(holder[0], while_in_use="pause")  # turned off: paused again, at once
    c.reconsider(1001.0)
    assert me.state == PAUSED


def test_node_status_carries_the_policy() -> None:
    p = ThrottlePolicy(idle_minutes=5.0, while_in_use="limit", hours="08:00-19:00", input_waived=True)
    st = NodeStatus("n1", "limited", "user active", PauseReason.INPUT, throttle_policy=p)
    back = NodeStatus.parse(st.to_json())
    assert back == st and back.throttle_policy == p
    assert NodeStatus.parse({"node": "n1", "state": "available"}).throttle_policy is None  # an older agent
