"""Notifications go through the desktop's notification service where there is one (issue 40, item
2): freedesktop's ``org.freedesktop.Notifications`` on a private session bus (``dbus-daemon``),
served by a fake typed as the specification says; the tray's :class:`gui.notify.Notifier` sends
each notice with its timeout, replaces the loss of the coordinator by its follow-up, and closes a
notice at its timeout where the service keeps it. Without the service: the tray's balloon."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gui.state import COORDINATOR, Notice
from tests.support.cli import REPO
from tests.support.qt import run
from tests.support.wait import wait_until

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("dbus-daemon") is None, reason="no dbus-daemon on this machine"),
]


def _calls(log: Path) -> list[Any]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[str]:
    """A private session bus: its address."""
    p = subprocess.Popen(
        ["dbus-daemon", "--session", "--nofork", "--print-address=1"], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None
    address = p.stdout.readline().strip()
    yield address
    p.terminate()
    p.wait(timeout=10)


@pytest.fixture
def service(bus: str, tmp_path: Path) -> Iterator[Path]:
    log = tmp_path / "notifications.jsonl"
    env = {**os.environ, "DBUS_SESSION_BUS_ADDRESS": bus, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-m", "tests.support.fake_notifications", str(log)], env=env, cwd=REPO)
    wait_until(lambda: "ready" in _calls(log), 60, what="the fake notification service", step=0.1)
    yield log
    p.terminate()
    p.wait(timeout=10)


def _notifier(address: str, name: str) -> Any:
    from PySide6.QtDBus import QDBusConnection
    from PySide6.QtWidgets import QSystemTrayIcon

    from gui.notify import Notifier

    conn = QDBusConnection.connectToBus(address, name)
    assert conn.isConnected()
    return Notifier(QSystemTrayIcon(), conn)


def test_notices_go_through_the_desktop_service_time_out_and_follow_ups_replace(
    qloop: asyncio.AbstractEventLoop, bus: str, service: Path
) -> None:
    n = _notifier(bus, "lakeshard-notify-test")
    lost = Notice(
        "lakeshard", "The cluster lost its coordinator (carol-laptop); electing another…", COORDINATOR, 60_000
    )
    back = Notice("lakeshard", "bob-laptop coordinates the cluster now.", COORDINATOR, 400)
    assert n.show(lost) == "dbus"
    assert n.show(back) == "dbus"
    run(qloop, asyncio.sleep(1.0))  # past the follow-up's timeout: closed (the loss's own timer: superseded)
    calls = [c for c in _calls(service) if c != "ready"]
    assert calls == [
        ["notify", "lakeshard", 0, "lakeshard", lost.text, 60_000],
        ["notify", "lakeshard", 1, "lakeshard", back.text, 400],  # replaces the loss on screen
        ["close", 1],
    ]


def test_without_the_service_the_tray_balloon_is_used(qloop: asyncio.AbstractEventLoop, bus: str) -> None:
    n = _notifier(bus, "lakeshard-notify-none")
    assert n.service() is None
    assert n.show(Notice("lakeshard", "This laptop contributes again.")) == "none"  # (offscreen: no tray either)
