"""The tray icon and its menu: the laptop's state at a glance, and the way to everything else.

:class:`TrayApp` follows the local agent (``/v1/node``, every ``poll_s``) and the cluster's
event stream, keeps the icon and tooltip current, rebuilds its menu each time it opens, and
notifies the user of what concerns them (:mod:`gui.notify`: the desktop's notification service
where there is one). All network work is asyncio on the Qt loop.

Its user's switch answers at once: Pause and Resume show the agent's answer as soon as it comes,
and a status read that was under way when the switch was flipped is dropped (it tells of the state
before). A pause says why and when it ends; "Contribute while I work" (the agent's
``throttle.while_in_use``: limit, not pause) stays on until it is turned off.

In a cluster or not: an agent with no cluster credentials waits for one (``no_cluster``), and
the menu then offers *Create a new cluster…* and *Join a cluster…* (:mod:`gui.cluster`); on the
laptop that holds the cluster's CA it offers *Invite a laptop…*, and the node map a revoke.

On its first start the tray opens the first-run window (:mod:`gui.first_run`: what lakeshard does
here, create or join, the hours it may contribute, start at login); its menu's *Set up this
laptop…* opens it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from PySide6.QtCore import QObject, QTimer, QUrl, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QMenu, QMessageBox, QSystemTrayIcon

from agent.protocol.cluster_view import ClusterView
from agent.protocol.codec import ProtocolError
from agent.protocol.events import Event, Snapshot, apply_event
from agent.protocol.status import NodeStatus
from gui.agent_process import AgentProcess, log_folder
from gui.client import ApiError, Client, Unreachable
from gui.folder import FolderDialog, open_folder
from gui.icons import state_icon
from gui.notify import Notifier
from gui.state import (
    TOOLTIPS,
    CoordinatorWatch,
    Notice,
    TrayState,
    can_resume,
    contributes_while_working,
    holds_ca,
    notices,
    status_line,
    tray_state,
    waiting_for_cluster,
)

log = logging.getLogger(__name__)
HOUR_S = 3600.0
WHILE_WORKING = "Contribute while I work"
SET_UP = "Set up this laptop…"
WATCH_S = 1.0  # how often a loss of the coordinator is weighed (CoordinatorWatch.tick)


class TrayApp(QObject):
    node_changed = Signal(object)  # the local agent's /v1/node (NodeStatus), or None
    cluster_event = Signal(object)  # (Event, ClusterView | None) from the coordinator's stream
    notified = Signal(str, str)

    def __init__(
        self,
        client: Client,
        agent: AgentProcess | None = None,
        *,
        poll_s: float = 1.0,
        on_quit: Callable[[], None] | None = None,
        confirm: Callable[[str, str], bool] | None = None,
        notifier: Notifier | None = None,
        open_url: Callable[[QUrl], bool] | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.agent = agent
        self.poll_s = poll_s
        self.on_quit = on_quit
        self.confirm = confirm or _ask  # yes/no questions (tests answer them)
        self.node: NodeStatus | None = None
        self.error: str | None = None
        self.view: ClusterView | None = None
        self.watch = CoordinatorWatch()
        self.names: dict[str, str] = {}
        self.state = TrayState.NO_CLUSTER
        self.shown: list[Notice] = []
        self.icon = QSystemTrayIcon(state_icon(self.state))
        self.notifier = notifier or Notifier(self.icon)
        self.open_url = open_url  # opens a folder in the file manager (None: the desktop's; tests give theirs)
        self.folder_dialog: FolderDialog | None = None
        self._switched = 0  # bumped by each flip of the switch: a status read begun before it is stale
        self.menu = QMenu()
        self.menu.aboutToShow.connect(self.build_menu)
        self.icon.setContextMenu(self.menu)
        self.icon.activated.connect(self._activated)
        self.chat: Any = None
        self.map: Any = None
        self.settings: Any = None
        self.join_dialog: Any = None
        self.invite_dialog: Any = None
        self.first_run: Any = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._tray_timer = QTimer(self)
        self._tray_timer.timeout.connect(self._show_when_tray_exists)
        self._watch_timer = QTimer(self)
        self._watch_timer.timeout.connect(self.weigh_coordinator)
        self.build_menu()
        self._apply()

    # -- running ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Begin following the agent and the cluster; the icon appears once a tray exists."""
        self._tasks.append(asyncio.ensure_future(self._follow_node()))
        self._tasks.append(asyncio.ensure_future(self._follow_events()))
        self._watch_timer.start(int(WATCH_S * 1000))
        self._show_when_tray_exists()
        if not self.icon.isVisible():
            self._tray_timer.start(1000)

    def _show_when_tray_exists(self) -> None:
        # at login the panel may come up after us: wait for it instead of failing
        if QSystemTrayIcon.isSystemTrayAvailable():
            self.icon.show()
            self._tray_timer.stop()

    async def async_stop(self) -> None:
        self._tray_timer.stop()
        self._watch_timer.stop()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        for w in (self.join_dialog, self.invite_dialog, self.folder_dialog, self.first_run):
            if w is not None:
                w.close()
        for w in (self.chat, self.map):
            if w is not None and hasattr(w, "async_stop"):
                await w.async_stop()
        self.icon.hide()
        await self.client.close()

    async def _follow_node(self) -> None:
        while True:
            await self.async_refresh()
            await asyncio.sleep(self.poll_s)

    async def async_refresh(self) -> None:
        """Read the local agent once (start it again if we started it and it died)."""
        if self.agent is not None and self.agent.exited():
            self._set(None, self.agent.failure())
            return
        switched = self._switched
        try:
            answer = await self.client.node()
        except Unreachable as e:
            if self.agent is not None and not self.agent.started_here:
                ok = await self.agent.async_ensure(timeout=2.0)  # the agent we attached to went away
                self._set(None, None if ok else self.agent.error)
            else:
                self._set(None, str(e) if self.node is not None else None)
            return
        if switched != self._switched:
            return  # the switch was flipped while this was read: it tells of the state before
        self._read(answer)

    def _read(self, answer: dict[str, Any]) -> None:
        """Show the agent's ``/v1/node``; one that does not read (a bad field) is an error the user sees."""
        try:
            node = NodeStatus.parse(answer)
        except ProtocolError as e:
            self._set(None, f"the agent's status does not read: {e}")
            return
        self._set(node, None)

    def _set(self, node: NodeStatus | None, error: str | None) -> None:
        for n in notices(self.node, node):
            self.notify(n)
        self.node, self.error = node, error
        self._apply()
        self.node_changed.emit(node)

    def _apply(self) -> None:
        self.state = tray_state(self.node, self.error)
        self.icon.setIcon(state_icon(self.state))
        self.icon.setToolTip(f"lakeshard: {TOOLTIPS[self.state]}\n{status_line(self.node, self.error)}")
        if not self.menu.isVisible():  # (an open menu is left as it is: rebuilt when it next opens)
            self.build_menu()

    async def _follow_events(self) -> None:
        while True:
            try:
                async for ev in self.client.events():
                    self.on_event(ev)
            except Unreachable:
                pass
            except Exception as e:  # a malformed event: say so, reconnect
                log.warning("cluster event stream: %s", e)
            await asyncio.sleep(1.0)

    def on_event(self, ev: Event) -> None:
        for n in self.watch.on_event(ev, self.names, time.time()):
            self.notify(n)
        self.view = apply_event(self.view, ev)
        if self.view is not None:
            self.names.update({n.node: n.name for n in self.view.nodes})
        self.cluster_event.emit((ev, self.view))

    def weigh_coordinator(self, now: float | None = None) -> None:
        """Tell a loss of the coordinator that lasted (every WATCH_S): the stream's facts, checked
        against the election's (this agent's ``/v1/node`` names the coordinator it follows)."""
        elected = self.node.coordinator if self.node is not None else None
        for n in self.watch.tick(time.time() if now is None else now, elected, self.names):
            self.notify(n)

    def notify(self, n: Notice) -> None:
        self.shown.append(n)
        self.notified.emit(n.title, n.text)
        how = self.notifier.show(n)
        log.info("notified (%s): %s", how, n.text)

    # -- the menu ---------------------------------------------------------------------------------
    def build_menu(self) -> None:
        """Rebuilt each time it opens, so that it says what is true now."""
        m = self.menu
        m.clear()
        head = m.addAction(status_line(self.node, self.error))
        head.setEnabled(False)
        m.addSeparator()
        if waiting_for_cluster(self.node):  # no credentials: the agent waits for these
            self._add(m, "Create a new cluster…", self.create_cluster)
            self._add(m, "Join a cluster…", self.show_join)
            m.addSeparator()
        self._add(m, "Open chat", self.show_chat)
        self._add(m, "Node map", self.show_map)
        if holds_ca(self.node):
            self._add(m, "Invite a laptop…", self.show_invite)
        m.addSeparator()
        if can_resume(self.node):
            self._add(m, "Resume contributing", lambda: self._run(self.async_resume()))
        else:
            sub = m.addMenu("Pause contributing")
            sub.setObjectName("pause")
            self._add(sub, "For 1 hour", lambda: self._run(self.async_pause(HOUR_S)))
            self._add(sub, "Until I resume", lambda: self._run(self.async_pause(None)))
            sub.setEnabled(self.node is not None and not waiting_for_cluster(self.node))
        working = contributes_while_working(self.node)
        w = self._add(m, WHILE_WORKING, lambda: self._run(self.async_contribute_while_working(not working)))
        w.setCheckable(True)
        w.setChecked(bool(working))
        w.setEnabled(working is not None and not waiting_for_cluster(self.node))
        w.setToolTip(
            "On: while you use this laptop it goes on contributing, at a lower share and priority, "
            "instead of pausing (until you turn this off)"
        )
        if self.error and self.agent is not None:
            self._add(m, "Restart the agent", lambda: self._run(self.async_restart_agent()))
        m.addSeparator()
        self._add(m, SET_UP, self.show_first_run)
        self._add(m, "Settings…", self.show_settings)
        self._add(m, "Open logs folder", self.open_logs)
        self._add(m, "About lakeshard", self.show_about)
        m.addSeparator()
        self._add(m, "Quit", self.quit)

    def _add(self, menu: QMenu, text: str, slot: Callable[[], Any]) -> QAction:
        a = menu.addAction(text)
        a.triggered.connect(slot)
        return a

    def action(self, text: str) -> QAction | None:
        """The menu's action called ``text`` (submenus included), as it is now."""
        for a in self.menu.actions():
            if a.text() == text:
                return a
            sub = a.menu()
            if isinstance(sub, QMenu):
                for b in sub.actions():
                    if b.text() == text:
                        return b
        return None

    def _run(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._tasks.append(asyncio.ensure_future(coro))
        self._tasks = [t for t in self._tasks if not t.done()]

    def _activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason == QSystemTrayIcon.ActivationReason.Trigger:
            self.show_chat()

    # -- actions ----------------------------------------------------------------------------------
    async def async_pause(self, for_s: float | None) -> None:
        await self._switch("paused", for_s)

    async def async_resume(self) -> None:
        await self._switch("available")

    async def _switch(self, state: str, for_s: float | None = None) -> None:
        """Flip the switch and show the agent's answer at once (a status read under way is dropped)."""
        self._switched += 1
        try:
            answer = await self.client.set_state(state, for_s)
        except Unreachable as e:
            self._set(self.node, str(e))
            return
        except ApiError as e:
            self.notify(Notice("lakeshard", f"The agent refused: {e}"))
            return
        self._switched += 1
        self._read(answer)

    async def async_contribute_while_working(self, on: bool) -> bool:
        """Turn "Contribute while I work" on (``throttle.while_in_use: limit`` in the agent's
        settings file, which the agent applies at once) or off (the default: pause); it stays
        as set until turned again. Whether the agent took it."""
        self._switched += 1
        try:
            cur = await self.client.settings()
            raw = dict(cur.get("settings") or {})
            th = dict(raw.get("throttle") or {})
            if on:
                th["while_in_use"] = "limit"
            else:
                th.pop("while_in_use", None)
            raw["throttle"] = th
            if not th:
                del raw["throttle"]
            await self.client.put_settings(raw)
            answer = await self.client.node()
        except (ApiError, Unreachable) as e:
            self.notify(Notice("lakeshard", f"{WHILE_WORKING} was not changed: {e}"))
            return False
        self._switched += 1
        self._read(answer)
        return True

    async def async_restart_agent(self) -> None:
        if self.agent is None:
            return
        await asyncio.to_thread(self.agent.stop)  # it may take seconds: not on the GUI thread
        self.agent.proc = None
        self._set(None, None)
        ok = await self.agent.async_ensure()
        self._set(None, None if ok else self.agent.error)

    def create_cluster(self) -> None:
        """Make this laptop the first of a new cluster (it will hold the cluster's CA)."""
        if self.confirm(
            "Create a new cluster",
            "Make this laptop the first of a new lakeshard cluster? It keeps the cluster's keys and "
            "invites the other laptops (Invite a laptop…). To join an existing cluster instead, use "
            "Join a cluster… with a token from one of its laptops.",
        ):
            self._run(self.async_create_cluster())

    async def async_create_cluster(self) -> bool:
        try:
            r = await self.client.cluster_init()
        except (ApiError, Unreachable) as e:
            self.notify(Notice("lakeshard", f"No cluster made: {e}"))
            return False
        self.notify(Notice("lakeshard", str(r.get("message") or "cluster made")))
        await self.async_refresh()
        return True

    def show_join(self) -> None:
        from gui.cluster import JoinDialog

        if self.join_dialog is None:
            self.join_dialog = JoinDialog(self.client)
            self.join_dialog.joined.connect(self._joined)
        _raise(self.join_dialog)

    def _joined(self, r: dict[str, Any]) -> None:
        self.notify(Notice("lakeshard", str(r.get("message") or "joined the cluster")))
        self._run(self.async_refresh())

    def welcome_if_new(self) -> bool:
        """On the first start (the first-run window never dismissed yet): open it. Whether it opened."""
        from gui.first_run import done

        if done():
            return False
        self.show_first_run()
        return True

    def show_first_run(self) -> None:
        from gui.first_run import FirstRunWindow

        if self.first_run is None:
            self.first_run = FirstRunWindow(self.client)
            self.first_run.cluster_changed.connect(lambda _r: self._run(self.async_refresh()))
        if not self.first_run.isVisible():  # (open already: the choices being made stay)
            self.first_run.load()
        _raise(self.first_run)

    def show_invite(self) -> None:
        from gui.cluster import InviteDialog

        if self.invite_dialog is None:
            self.invite_dialog = InviteDialog(self.client)
        _raise(self.invite_dialog)

    def show_chat(self) -> None:
        from gui.chat.window import ChatWindow

        if self.chat is None:
            self.chat = ChatWindow(self.client, names=self.names)
            self.chat.cluster = self.view  # (who serves answers, and after a failover who went on)
            self.cluster_event.connect(self.chat.on_cluster_event)
        _raise(self.chat)

    def show_map(self) -> None:
        from gui.nodemap import NodeMapWindow

        if self.map is None:
            self.map = NodeMapWindow(
                self.client,
                me=lambda: self.node.node if self.node else None,
                holds_ca=lambda: holds_ca(self.node),
                confirm=lambda title, text: self.confirm(title, text),
            )
            self.cluster_event.connect(self.map.on_event)
            if self.view is not None:
                self.map.on_event((Snapshot(time.time(), self.view), self.view))
        _raise(self.map)

    def show_settings(self) -> None:
        from gui.settings import SettingsDialog

        if self.settings is None:
            self.settings = SettingsDialog(self.client, restart_agent=self._restart_if_ours)
        self.settings.load()
        _raise(self.settings)

    def _restart_if_ours(self) -> bool:
        if self.agent is None or not self.agent.started_here:
            return False
        self._run(self.async_restart_agent())
        return True

    def open_logs(self) -> None:
        """The logs folder in the file manager; where none opens it, a dialog with its path and Copy."""
        folder = (self.node.log_dir if self.node else None) or str(log_folder())
        if open_folder(folder, self.open_url):
            return
        log.info("no file manager opened %s: showing its path", folder)
        if self.folder_dialog is not None:
            self.folder_dialog.close()
        self.folder_dialog = FolderDialog(folder, "logs folder")
        _raise(self.folder_dialog)

    def show_about(self) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            __version__ = version("lakeshard")
        except PackageNotFoundError:
            __version__ = "(development)"
        n = self.node
        QMessageBox.about(
            None,
            "About lakeshard",
            f"<b>lakeshard {__version__}</b><br>Pools the idle laptops of an office into one LLM.<br><br>"
            f"This laptop: {(n and n.name) or '-'} (node {(n and n.node) or '-'})<br>"
            f"Cluster: {(n and n.cluster) or '-'}<br>Logs: {(n and n.log_dir) or log_folder()}",
        )

    def quit(self) -> None:
        if self.on_quit is not None:
            self.on_quit()


def _ask(title: str, text: str) -> bool:
    from gui.cluster import ask

    return ask(title, text)


def _raise(w: Any) -> None:
    w.show()
    w.raise_()
    w.activateWindow()
