"""A pause that explains itself (issue 40, item 1): the tooltip and the menu's status line say why
this laptop is paused or limited and when that ends, from the throttle policy the agent runs
with; Resume shows at once (a status read under way when it was clicked is dropped, not shown);
"Contribute while I work" is kept in the agent's settings until it is turned off. Offscreen,
against an in-process fake of the local agent."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.protocol.status import NodeStatus
from gui.icons import state_icon
from gui.notify import Notifier
from gui.state import TrayState, can_resume, contributes_while_working, explain, status_line
from gui.tray import WHILE_WORKING, TrayApp
from tests.support.fake_backend import NODE, FakeBackend
from tests.support.qt import run
from tests.support.wait import async_wait_until

POLICY = {"idle_minutes": 2.0, "while_in_use": "pause", "temp_low_c": 80.0, "hours": "08:00-19:00"}


def _n(**kw: Any) -> NodeStatus:
    return NodeStatus.parse({**NODE, "throttle_policy": POLICY, **kw})


@pytest.mark.parametrize(
    ("node", "text"),
    [
        (_n(), None),
        (
            _n(state="paused", reason="user active", reason_kind="input"),
            "paused while you use this laptop; contributes again after 2 min idle",
        ),
        (
            _n(state="paused", reason="user active", reason_kind="input", throttle_policy={"idle_minutes": 0.5}),
            "paused while you use this laptop; contributes again after 30 s idle",
        ),
        (
            _n(state="limited", reason="user active", reason_kind="input"),
            "contributing less while you use this laptop; fully again after 2 min idle",
        ),
        (_n(state="paused", reason="92 C", reason_kind="heat"), "paused: 92 C; contributes again at 80 °C or below"),
        (
            _n(state="paused", reason="on battery", reason_kind="battery"),
            "paused: on battery; contributes again when plugged in",
        ),
        (
            _n(state="paused", reason="lid closed", reason_kind="lid"),
            "paused: lid closed; contributes again when the lid opens",
        ),
        (
            _n(state="paused", reason="outside the hours set for contributing", reason_kind="schedule"),
            "paused outside the hours set for contributing (08:00-19:00); contributes again within them",
        ),
        (
            _n(state="limited", reason="other programs use 70% CPU", reason_kind="load"),
            "contributing less: other programs use 70% CPU; fully again once other programs use 30% CPU or less",
        ),
        (_n(state="paused", reason="user", reason_kind="switch"), "paused until you resume"),
        # an older agent (no kind, no policy): its own words
        (_n(state="paused", reason="user active", throttle_policy=None), "paused: user active"),
        (
            _n(state="paused", reason="user active", reason_kind="input", throttle_policy=None),
            "paused while you use this laptop; contributes again once you leave it idle",
        ),
    ],
)
def test_a_pause_says_why_and_when_it_ends(node: NodeStatus, text: str | None) -> None:
    assert explain(node) == text
    if text is not None:
        assert status_line(node).startswith(text)


@pytest.mark.parametrize(
    ("node", "resume", "working"),
    [
        (_n(), False, False),
        (_n(state="paused", reason="user", reason_kind="switch"), True, False),
        (_n(state="paused", reason="user active", reason_kind="input"), True, False),  # resuming: limited, now
        (_n(state="limited", reason="user active", reason_kind="input"), False, False),
        (_n(state="paused", reason="92 C", reason_kind="heat"), False, False),  # no switch undoes heat
        (_n(throttle_policy={"while_in_use": "limit"}), False, True),
        (_n(throttle_policy=None), False, None),  # an older agent: unknown
    ],
)
def test_resume_and_contribute_while_i_work_apply_where_they_can(
    node: NodeStatus, resume: bool, working: bool | None
) -> None:
    assert can_resume(node) is resume
    assert contributes_while_working(node) is working


@pytest.fixture
def tray(qloop: asyncio.AbstractEventLoop) -> Iterator[tuple[TrayApp, FakeBackend]]:
    fake = FakeBackend()
    t = TrayApp(fake)  # type: ignore[arg-type]
    t.notifier = Notifier(t.icon, use_dbus=False)
    yield t, fake
    if fake.hold is not None:
        fake.hold.set()
    run(qloop, t.async_stop())


def _agent_resumes_while_in_use(state: str, _for_s: float | None) -> dict[str, Any]:
    """The agent's answer to the switch while its user types: resuming contributes, limited."""
    d = copy.deepcopy({**NODE, "throttle_policy": POLICY})
    if state == "available":
        d.update(state="limited", reason="user active", reason_kind="input")
        d["throttle_policy"] = {**POLICY, "input_waived": True}
    else:
        d.update(state="paused", reason="user", reason_kind="switch")
    return d


def test_resume_clears_the_stale_pause_at_once(
    qloop: asyncio.AbstractEventLoop, tray: tuple[TrayApp, FakeBackend]
) -> None:
    t, fake = tray
    fake.node_json.update(state="paused", reason="user active", reason_kind="input", throttle_policy=POLICY)
    fake.switch = _agent_resumes_while_in_use
    run(qloop, t.async_refresh())
    paused = "paused while you use this laptop; contributes again after 2 min idle, 2 peers"
    assert t.state is TrayState.PAUSED_USER
    assert t.menu.actions()[0].text() == paused
    assert paused in t.icon.toolTip()
    resume = t.action("Resume contributing")
    assert resume is not None

    async def scenario() -> None:
        fake.hold = asyncio.Event()
        poll = asyncio.ensure_future(t.async_refresh())  # a status read under way: it answers "paused"
        await async_wait_until(lambda: fake.reads == 2, what="the poll to be under way")
        resume.trigger()  # the user clicks Resume while it is out
        await async_wait_until(lambda: fake.switched, what="the switch to reach the agent")
        await async_wait_until(lambda: t.state is TrayState.LIMITED, what="the resumed state", timeout=5)
        # at once: the menu, the tooltip and the icon, with the read still out
        assert not poll.done()
        now = "contributing less while you use this laptop; fully again after 2 min idle, no stage, 2 peers"
        assert t.menu.actions()[0].text() == now
        assert now in t.icon.toolTip() and "paused" not in t.icon.toolTip()
        assert t.icon.icon().cacheKey() == state_icon(TrayState.LIMITED).cacheKey()
        assert t.action("Resume contributing") is None and t.action("Until I resume") is not None
        fake.hold.set()  # the stale read comes back: dropped
        await poll
        assert t.state is TrayState.LIMITED and "paused" not in t.menu.actions()[0].text()

    run(qloop, scenario(), timeout=30)
    assert fake.switched == [("available", None)]


def test_contribute_while_i_work_is_kept_in_the_agents_settings_until_turned_off(
    qloop: asyncio.AbstractEventLoop, tray: tuple[TrayApp, FakeBackend]
) -> None:
    t, fake = tray
    fake.file = {"name": "alice-laptop", "throttle": {"idle_minutes": 2}}
    fake.node_json.update(state="paused", reason="user active", reason_kind="input", throttle_policy=POLICY)

    def agent_applies(file: dict[str, Any]) -> None:  # the agent takes throttle settings at once
        mode = (file.get("throttle") or {}).get("while_in_use", "pause")
        fake.node_json["throttle_policy"] = {**POLICY, "while_in_use": mode}
        if mode == "limit":
            fake.node_json.update(state="limited")
        else:
            fake.node_json.update(state="paused")

    fake.on_settings = agent_applies
    run(qloop, t.async_refresh())
    toggle = t.action(WHILE_WORKING)
    assert toggle is not None and toggle.isCheckable() and not toggle.isChecked() and toggle.isEnabled()

    toggle.trigger()
    run(qloop, async_wait_until(lambda: t.state is TrayState.LIMITED, what="limited while working", timeout=5))
    assert fake.file == {"name": "alice-laptop", "throttle": {"idle_minutes": 2, "while_in_use": "limit"}}
    on = t.action(WHILE_WORKING)
    assert on is not None and on.isChecked()
    assert t.menu.actions()[0].text().startswith("contributing less while you use this laptop")

    # a tray started later (after a restart, a login) finds it on: it lives in the agent's settings
    later = TrayApp(fake)  # type: ignore[arg-type]
    later.notifier = Notifier(later.icon, use_dbus=False)
    run(qloop, later.async_refresh())
    kept = later.action(WHILE_WORKING)
    assert kept is not None and kept.isChecked()
    run(qloop, later.async_stop())

    on.trigger()  # turned off: the key goes (the default: pause)
    run(qloop, async_wait_until(lambda: t.state is TrayState.PAUSED_USER, what="paused again", timeout=5))
    assert fake.file == {"name": "alice-laptop", "throttle": {"idle_minutes": 2}}
    off = t.action(WHILE_WORKING)
    assert off is not None and not off.isChecked()


def test_a_timed_pause_still_says_until_when(
    tray: tuple[TrayApp, FakeBackend], qloop: asyncio.AbstractEventLoop
) -> None:
    t, fake = tray
    until = time.time() + 3600
    fake.node_json.update(state="paused", reason="user", reason_kind="switch", paused_until=until)
    run(qloop, t.async_refresh())
    assert t.menu.actions()[0].text().startswith("paused until " + time.strftime("%H:%M", time.localtime(until)))
    assert t.action("Resume contributing") is not None
