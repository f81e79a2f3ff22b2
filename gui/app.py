"""``lakeshard tray``: the app every laptop runs at login.

One instance per user (a second launch brings the running one's chat window forward and
exits); Qt and asyncio share one loop through qasync; the app starts or attaches to the local
agent and stays in the tray when its windows close, until Quit.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import hashlib
import logging
import logging.handlers
import os
import signal
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
TRAY_STOP_S = 0.5  # on Quit: for the windows and the tray's connections to close


def instance_name() -> str:
    """The single-instance key: per user, and per LAKESHARD_HOME (tests run side by side)."""
    home = os.environ.get("LAKESHARD_HOME", "")
    tag = hashlib.sha1(home.encode()).hexdigest()[:8] if home else "default"
    return f"lakeshard-tray-{getpass.getuser()}-{tag}"


class SingleInstance:
    """A local socket named per user: the first instance listens, later ones knock and leave."""

    def __init__(self, name: str) -> None:
        from PySide6.QtNetwork import QLocalServer

        self.name = name
        self.server = QLocalServer()
        self.knocks = 0
        self.on_knock: Any = None

    def knock(self) -> bool:
        """Whether another instance answered (and was asked to come forward)."""
        from PySide6.QtNetwork import QLocalSocket

        s = QLocalSocket()
        s.connectToServer(self.name)
        if not s.waitForConnected(500):
            return False
        s.write(b"show\n")
        s.flush()
        s.waitForBytesWritten(500)
        s.disconnectFromServer()
        return True

    def listen(self) -> bool:
        from PySide6.QtNetwork import QLocalServer

        if not self.server.listen(self.name):
            QLocalServer.removeServer(self.name)  # a stale socket from a crashed instance
            if not self.server.listen(self.name):
                return False
        self.server.newConnection.connect(self._accept)
        return True

    def _accept(self) -> None:
        while self.server.hasPendingConnections():
            c = self.server.nextPendingConnection()
            c.readyRead.connect(lambda c=c: self._read(c))

    def _read(self, c: Any) -> None:
        if bytes(c.readAll().data()).strip() == b"show":
            self.knocks += 1
            if self.on_knock is not None:
                self.on_knock()
        c.disconnectFromServer()


def setup_logging() -> Path:
    """Log to ``tray.log`` in the log folder, once: ``lakeshard tray`` comes through the command
    line, which already logs there (``agent.common.logs``, by the command's name); a second
    handler on the same file wrote every line twice. Only when no handler writes to that file yet
    (the tray started another way) is one added. The file's path."""
    from gui.agent_process import log_folder

    path = log_folder() / "tray.log"
    root = logging.getLogger()
    for h in root.handlers:
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename).resolve() == path.resolve():
            return path
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    fh = logging.handlers.RotatingFileHandler(path, maxBytes=2_000_000, backupCount=2)
    fh.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"))
    root.addHandler(fh)
    return path


def run_tray(args: argparse.Namespace) -> int:
    import qasync
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from gui.agent_process import AgentProcess
    from gui.client import Client
    from gui.icons import app_icon
    from gui.settings import load_tray_settings
    from gui.tray import TrayApp

    setup_logging()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    assert isinstance(app, QApplication)
    app.setApplicationName("lakeshard")
    app.setQuitOnLastWindowClosed(False)  # closing the chat leaves the tray running
    app.setWindowIcon(app_icon())
    single = SingleInstance(instance_name())
    if single.knock():
        print("lakeshard tray is already running; brought it forward", flush=True)
        return 0
    if not single.listen():
        print("lakeshard: error: cannot claim the single-instance socket", file=sys.stderr)
        return 2
    port = args.api_port if args.api_port is not None else _settings_api_port()
    agent_url = f"http://127.0.0.1:{port}"
    prefs = load_tray_settings()
    client = Client(agent_url, prefs.get("coordinator_url"), prefs.get("api_key"))
    agent = None if args.no_agent else AgentProcess(Client(agent_url), port, args.agent_arg)
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    done = asyncio.Event()
    # SIGTERM / ^C quit cleanly (the agent we started stops too); the timer lets Python see signals
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: loop.call_soon_threadsafe(done.set))
    wake = QTimer()
    wake.start(250)
    wake.timeout.connect(lambda: None)
    tray = TrayApp(client, agent, on_quit=done.set)
    single.on_knock = tray.show_chat

    async def main() -> None:
        if agent is not None:  # (a Quit or SIGTERM while the agent starts is not kept waiting)
            ensure, quit_ = asyncio.ensure_future(agent.async_ensure()), asyncio.ensure_future(done.wait())
            await asyncio.wait({ensure, quit_}, return_when=asyncio.FIRST_COMPLETED)
            quit_.cancel()
            if not ensure.done():
                ensure.cancel()
            elif not ensure.result():
                tray._set(None, agent.error)
        if not done.is_set():
            tray.start()
            tray.welcome_if_new()  # the first start: the first-run window
            print(f"lakeshard tray: following the agent at {agent_url}", flush=True)
            await done.wait()
        # Quit (or SIGTERM) ends within 2 s: the agent we started leaves meanwhile (STOP_S)
        if agent is not None:
            agent.terminate()
        await _within(tray.async_stop(), TRAY_STOP_S)
        if agent is not None:
            await asyncio.to_thread(agent.stop)

    with loop:
        loop.run_until_complete(main())
    single.server.close()  # (removes its socket file)
    # Qt's and the interpreter's teardown would take another 1.5 s or so, for nothing
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _within(aw: Any, seconds: float) -> None:
    """Await ``aw`` for at most ``seconds``, then leave it cancelled (not waited for)."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        log.warning("closing the tray's windows took over %.1f s: quitting anyway", seconds)
    elif not task.cancelled() and task.exception() is not None:
        log.warning("closing the tray's windows failed: %s", task.exception())


def _settings_api_port() -> int:
    """The status API port from config.yaml (7701 unless set), read the way the agent reads it."""
    import yaml

    from gui.settings import tray_settings_file

    f = tray_settings_file().parent / "config.yaml"
    try:
        d = yaml.safe_load(f.read_text(encoding="utf-8")) if f.is_file() else None
    except (OSError, yaml.YAMLError):
        d = None
    v = d.get("api_port") if isinstance(d, dict) else None
    return v if isinstance(v, int) and 0 < v < 65536 else 7701
