"""The first-run window (issue 40, item 6): what lakeshard does on this laptop, Create or Join with
a pasted token, the hours it may contribute and start at login. The tray opens it on its first
start and not on the next; its menu opens it again. Offscreen, against an in-process fake of the
local agent (which records each settings file written), with private folders for the tray's
settings and start at login."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtCore import QTime
from PySide6.QtWidgets import QApplication

from gui import autostart
from gui.client import ApiError, Unreachable
from gui.first_run import (
    ANY_TIME,
    DONE_KEY,
    WORK,
    FirstRunWindow,
    Hours,
    done,
    hours_of,
    hours_words,
    steps_aside,
    with_hours,
)
from gui.notify import Notifier
from gui.settings import load_tray_settings
from gui.tray import SET_UP, TrayApp
from tests.support.fake_backend import FakeBackend
from tests.support.qt import run
from tests.support.wait import async_wait_until

BAD_TOKEN = "not a lakeshard join token (a token starts with lsj1-)"  # the agent's words (agent.security.tokens)
WEEKDAYS = ["mon", "tue", "wed", "thu", "fri"]


@pytest.mark.parametrize(
    ("throttle", "hours"),
    [
        (None, ANY_TIME),
        ({"idle_minutes": 2}, ANY_TIME),
        ({"days": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]}, ANY_TIME),  # as an agent runs it
        ({"hours": "08:00-19:00", "days": WEEKDAYS}, WORK),
        ({"hours": "22:00-06:00", "days": ["Saturday", "sun"]}, Hours("22:00-06:00", ("sat", "sun"))),
        ({"days": ["fri", "mon"]}, Hours(None, ("mon", "fri"))),
    ],
)
def test_the_hours_a_throttle_section_gives(throttle: Any, hours: Hours) -> None:
    assert hours_of(throttle) == hours


def test_the_hours_written_change_only_hours_and_days() -> None:
    raw = {"name": "alice-laptop", "throttle": {"idle_minutes": 5, "hours": "09:00-17:00"}}
    assert with_hours(raw, WORK) == {
        "name": "alice-laptop",
        "throttle": {"idle_minutes": 5, "hours": "08:00-19:00", "days": WEEKDAYS},
    }
    assert with_hours(raw, ANY_TIME) == {"name": "alice-laptop", "throttle": {"idle_minutes": 5}}
    assert with_hours({"throttle": {"days": ["mon"]}}, ANY_TIME) == {}  # an emptied section goes
    assert raw["throttle"] == {"idle_minutes": 5, "hours": "09:00-17:00"}  # (pure)
    assert hours_words(ANY_TIME) == "any time"
    assert hours_words(WORK) == "from 08:00 to 19:00, Mon-Fri"
    assert hours_words(Hours("22:00-06:00", ("sat", "sun"))) == "from 22:00 to 06:00, Sat, Sun"
    assert hours_words(Hours(None, ("mon",))) == "all day, Mon"


def test_when_it_steps_aside_follows_what_the_agent_runs_with() -> None:
    default = steps_aside(None)
    assert default[0].startswith("while you use it (keyboard or mouse): it pauses at once, and goes on after 2 min")
    assert "when it runs hot: it pauses at 90 °C, until it cools to 80 °C" in default
    assert "on battery: it pauses until the laptop is plugged in" in default
    mine = steps_aside({"while_in_use": "limit", "idle_minutes": 0.5, "on_battery": "run", "cpu_high_pct": "off"})
    assert mine[0] == "while you use it: it contributes less, at low priority, and fully after 30 s idle"
    assert "on battery: it pauses below 30 % charge" in mine
    assert not any("processor" in line for line in mine)
    assert steps_aside({"enabled": False}) == [
        "stepping aside is turned off in Settings: it contributes whenever the agent runs"
    ]


@pytest.fixture
def fake(qapp: QApplication, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeBackend]:
    """An agent in no cluster yet; the tray's settings and start at login in private folders. As
    in the tray app, closing the last window (Finish) leaves the app, and its event loop, running."""
    monkeypatch.setenv("LAKESHARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "sys"))  # no system-wide entry here
    monkeypatch.setenv("HOME", str(tmp_path))
    f = FakeBackend()
    f.node_json = {"node": "me", "state": "no_cluster", "role": "no_cluster", "hint": "no cluster yet"}
    f.file = {"name": "alice-laptop", "throttle": {"idle_minutes": 2}}
    quits = qapp.quitOnLastWindowClosed()
    qapp.setQuitOnLastWindowClosed(False)
    yield f
    qapp.setQuitOnLastWindowClosed(quits)


@pytest.fixture
def window(qloop: asyncio.AbstractEventLoop, fake: FakeBackend) -> Iterator[FirstRunWindow]:
    w = FirstRunWindow(fake)  # type: ignore[arg-type]
    w.show()
    run(qloop, w.async_load())
    yield w
    w.close()


def _tray(fake: FakeBackend) -> TrayApp:
    t = TrayApp(fake)  # type: ignore[arg-type]
    t.notifier = Notifier(t.icon, use_dbus=False)
    return t


def test_shown_on_the_first_start_and_not_on_the_second(qloop: asyncio.AbstractEventLoop, fake: FakeBackend) -> None:
    first = _tray(fake)
    assert not done()
    assert first.welcome_if_new()
    w = first.first_run
    assert isinstance(w, FirstRunWindow) and w.isVisible()
    run(qloop, async_wait_until(lambda: "not in a cluster yet" in w.cluster_status.text(), what="the agent read"))
    assert w.cluster_row.isEnabled() and "steps aside by itself" in w.about.text()
    w.later_btn.click()  # Not now: dismissed, and remembered in the tray's own settings
    assert not w.isVisible() and done() and load_tray_settings()[DONE_KEY] is True
    run(qloop, first.async_stop())

    second = _tray(fake)  # the next start
    assert not second.welcome_if_new()
    assert second.first_run is None
    run(qloop, second.async_stop())


def test_reachable_from_the_menu(qloop: asyncio.AbstractEventLoop, fake: FakeBackend) -> None:
    t = _tray(fake)
    run(qloop, t.async_refresh())
    t.build_menu()
    set_up = t.action(SET_UP)
    assert set_up is not None and set_up.isEnabled()
    set_up.trigger()
    w = t.first_run
    assert isinstance(w, FirstRunWindow) and w.isVisible()
    run(qloop, async_wait_until(lambda: "not in a cluster yet" in w.cluster_status.text(), what="the agent read"))
    w.finish_btn.click()  # Finish: nothing changed, nothing written; closed, and remembered
    run(qloop, async_wait_until(lambda: not w.isVisible(), what="the window to close"))
    assert fake.put == [] and done()
    again = t.action(SET_UP)  # opened again from the menu after it was dismissed
    assert again is not None
    again.trigger()
    assert w.isVisible()
    run(qloop, t.async_stop())


def test_join_with_a_token_calls_the_agent_and_shows_success(
    qloop: asyncio.AbstractEventLoop, fake: FakeBackend
) -> None:
    t = _tray(fake)
    t.show_first_run()
    w = t.first_run
    assert isinstance(w, FirstRunWindow)
    run(qloop, async_wait_until(lambda: w.node is not None, what="the agent read"))
    w.token.setText("  lsj1-AAAA  ")
    w.join_btn.click()
    assert not w.join_btn.isEnabled() and w.cluster_message.text().startswith("joining…")
    run(qloop, async_wait_until(lambda: w.cluster_message.text().startswith("Done"), what="the join"))
    assert fake.joins == ["lsj1-AAAA"]
    assert w.cluster_message.text() == "Done: joined cluster office-3f as node me."
    run(qloop, async_wait_until(lambda: "in cluster office-3f" in w.cluster_status.text(), what="the member"))
    assert not w.cluster_row.isEnabled() and w.token.text() == ""
    # the tray follows at once (its menu then offers no Create / Join)
    run(qloop, async_wait_until(lambda: t.node is not None and t.node.cluster == "office-3f", what="the tray"))
    t.build_menu()
    assert t.action("Join a cluster…") is None
    run(qloop, t.async_stop())


def test_create_a_cluster_from_the_window(qloop: asyncio.AbstractEventLoop, window: FirstRunWindow) -> None:
    w = window
    fake: FakeBackend = w.client  # type: ignore[assignment]
    w.create_btn.click()
    run(qloop, async_wait_until(lambda: w.cluster_message.text().startswith("Done"), what="the cluster made"))
    assert fake.inits == 1 and fake.joins == []
    run(qloop, async_wait_until(lambda: "holds the cluster's keys" in w.cluster_status.text(), what="the CA holder"))


def test_a_bad_token_shows_the_agents_error_in_the_window(
    qloop: asyncio.AbstractEventLoop, window: FirstRunWindow
) -> None:
    w = window
    fake: FakeBackend = w.client  # type: ignore[assignment]

    def refuse(_token: str) -> dict[str, Any]:  # the agent's 400 for a token that is none
        raise ApiError(400, BAD_TOKEN, "cluster_error")

    fake.join = refuse
    w.join()  # nothing pasted: said, and nothing asked
    assert "Paste a join token first" in w.cluster_message.text() and fake.joins == []
    w.token.setText("hello")
    w.token.returnPressed.emit()  # Enter joins too
    run(qloop, async_wait_until(lambda: w.cluster_message.text().startswith("Not done"), what="the refusal"))
    assert fake.joins == ["hello"]
    assert w.cluster_message.text() == f"Not done: {BAD_TOKEN}"
    assert w.join_btn.isEnabled() and w.create_btn.isEnabled() and w.cluster_row.isEnabled()
    assert w.token.text() == "hello" and w.isVisible()  # to be corrected, not retyped

    async def gone() -> dict[str, Any]:
        raise Unreachable("nothing answers at http://127.0.0.1:7701/v1/cluster/join (Connection refused)")

    fake.cluster_join = lambda _token: gone()  # type: ignore[method-assign]
    w.join_btn.click()
    run(qloop, async_wait_until(lambda: "Connection refused" in w.cluster_message.text(), what="the agent gone"))


def test_the_hours_chosen_are_written_to_the_agents_settings(
    qloop: asyncio.AbstractEventLoop, window: FirstRunWindow
) -> None:
    w = window
    fake: FakeBackend = w.client  # type: ignore[assignment]
    assert w.any_time.isChecked() and not w.start_time.isEnabled()  # the file sets no hours
    w.work.setChecked(True)
    assert run(qloop, w.async_finish())
    assert fake.put[-1] == {
        "name": "alice-laptop",
        "throttle": {"idle_minutes": 2, "hours": "08:00-19:00", "days": WEEKDAYS},
    }
    assert not w.isVisible()
    assert "it contributes from 08:00 to 19:00, Mon-Fri" in w.message.text()

    # opened again, it shows what the agent runs with; custom hours, over midnight at weekends
    run(qloop, w.async_load())
    assert w.work.isChecked()
    w.custom.setChecked(True)
    assert w.start_time.isEnabled()
    w.start_time.setTime(QTime(22, 0))
    w.end_time.setTime(QTime(6, 0))
    for box in w.day_boxes:
        box.setChecked(box.text() in ("Sat", "Sun"))
    assert run(qloop, w.async_finish())
    assert fake.put[-1]["throttle"] == {"idle_minutes": 2, "hours": "22:00-06:00", "days": ["sat", "sun"]}
    run(qloop, w.async_load())
    assert w.custom.isChecked() and w.start_time.time().toString("HH:mm") == "22:00"
    assert [b.isChecked() for b in w.day_boxes] == [False] * 5 + [True] * 2

    # no day at all: said, nothing written, the window stays
    for box in w.day_boxes:
        box.setChecked(False)
    w.show()
    n = len(fake.put)
    assert not run(qloop, w.async_finish())
    assert w.message.text() == "Not finished: choose at least one day it may contribute on." and len(fake.put) == n
    assert w.isVisible()

    # any time: the keys go
    w.any_time.setChecked(True)
    assert run(qloop, w.async_finish())
    assert fake.put[-1] == {"name": "alice-laptop", "throttle": {"idle_minutes": 2}}


def test_an_agent_that_does_not_answer_is_said_and_the_window_stays(
    qloop: asyncio.AbstractEventLoop, window: FirstRunWindow
) -> None:
    w = window
    fake: FakeBackend = w.client  # type: ignore[assignment]

    async def gone() -> dict[str, Any]:
        raise Unreachable("nothing answers at http://127.0.0.1:7701/v1/settings (Connection refused)")

    fake.settings = gone  # type: ignore[method-assign]
    w.work.setChecked(True)
    assert not run(qloop, w.async_finish())
    assert w.message.text().startswith("Not saved: the agent does not answer (nothing answers at")
    assert w.isVisible() and w.finish_btn.isEnabled() and fake.put == [] and not done()
    run(qloop, w.async_load())  # read when it cannot be: said too
    assert "cannot be read yet" in w.message.text()


def test_start_at_login_toggles_autostart(qloop: asyncio.AbstractEventLoop, window: FirstRunWindow) -> None:
    w = window
    entry = autostart.xdg_autostart_file()
    assert str(entry).startswith(str(Path.home())) and not entry.exists()  # (the private folder)
    assert not w.autostart.isChecked()
    w.autostart.setChecked(True)
    assert run(qloop, w.async_finish())
    assert entry.is_file() and autostart.is_enabled()
    assert "agent tray" in entry.read_text(encoding="utf-8")
    assert "start at login on" in w.message.text()

    run(qloop, w.async_load())  # opened again: as it is now
    assert w.autostart.isChecked()
    w.autostart.setChecked(False)
    assert run(qloop, w.async_finish())
    assert not entry.exists() and not autostart.is_enabled()
