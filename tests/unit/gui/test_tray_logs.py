"""Logs (issue 40, item 8): ``tray.log`` gets each line once (``lakeshard tray`` comes through the
command line, which already logs to it; the tray's own handler doubled every line), and "Open
logs folder" shows the folder's path with a Copy button where no file manager opens it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication

from gui.notify import Notifier
from gui.tray import TrayApp
from tests.support.fake_backend import FakeBackend
from tests.support.qt import run


@pytest.fixture
def bare_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[logging.Logger]:
    """The root logger with no handlers (as at a process's start), logs in a private folder."""
    monkeypatch.setenv("LAKESHARD_HOME", str(tmp_path / "home"))
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    root.handlers = []
    yield root
    for h in root.handlers:
        h.close()
    root.handlers, root.level = saved, level


def test_tray_log_gets_each_line_once(bare_root: logging.Logger) -> None:
    from agent.common.logs import log_name, setup_logging
    from gui.app import setup_logging as tray_logging

    setup_logging(False, log_name("tray"))  # what `lakeshard tray` does first (agent.cli.main)
    path = tray_logging()  # then the tray's own set-up
    tray_logging()  # (twice: still once)
    logging.getLogger("gui.tray").warning("one line, once")
    for h in bare_root.handlers:
        h.flush()
    assert path.name == "tray.log"
    assert path.read_text(encoding="utf-8").count("one line, once") == 1
    files = [h for h in bare_root.handlers if isinstance(h, logging.FileHandler)]
    assert len(files) == 1


def test_the_tray_logs_on_its_own_when_started_another_way(bare_root: logging.Logger) -> None:
    from gui.app import setup_logging as tray_logging

    path = tray_logging()
    logging.getLogger("gui.tray").warning("started without the command line")
    for h in bare_root.handlers:
        h.flush()
    assert path.read_text(encoding="utf-8").count("started without the command line") == 1


@pytest.mark.parametrize("opens", [True, False])
def test_open_logs_folder_falls_back_to_a_dialog_with_copy(
    qloop: asyncio.AbstractEventLoop, tmp_path: Path, opens: bool
) -> None:
    fake = FakeBackend()
    fake.node_json["log_dir"] = str(tmp_path / "logs")
    asked: list[QUrl] = []

    def opener(url: QUrl) -> bool:  # a desktop with (True) or without (False) a file manager
        asked.append(url)
        return opens

    t = TrayApp(fake, open_url=opener)  # type: ignore[arg-type]
    t.notifier = Notifier(t.icon, use_dbus=False)
    run(qloop, t.async_refresh())
    action = t.action("Open logs folder")
    assert action is not None
    action.trigger()
    assert [u.toLocalFile() for u in asked] == [str(tmp_path / "logs")]
    if opens:
        assert t.folder_dialog is None
    else:
        d = t.folder_dialog
        assert d is not None and d.isVisible()
        assert d.path.text() == str(tmp_path / "logs") and d.path.isReadOnly()
        d.copy_btn.click()
        assert QGuiApplication.clipboard().text() == str(tmp_path / "logs")
        assert d.copied.text() == "copied to the clipboard"
    run(qloop, t.async_stop())
    assert t.folder_dialog is None or not t.folder_dialog.isVisible()
