"""Notifications through the desktop's own service where there is one, and the tray's balloon elsewhere.

On a Linux desktop (GNOME, KDE, XFCE, dunst, ...) that is freedesktop's
``org.freedesktop.Notifications`` on the session bus, over QtDBus: the notification lands in the
desktop's own list, with its own look, and goes after its timeout. Elsewhere (Windows, whose
tray balloons are toasts; macOS; a desktop with no such service) it is the tray icon's
``showMessage``, with the same timeout.

Either way a notification goes after its ``timeout_ms``: where the service keeps it longer
(some ignore the expiry they are given) it is closed then. A notice with the same ``key`` as one
still on screen replaces it (the coordinator's follow-up replaces its loss).

QtDBus needs typed arguments (``u``, ``as``, ``a{sv}``), which a Python int or list does not
give; the call goes through the interface's introspected method, ``Notify(QString, uint, ...)``,
with each argument typed by ``Q_ARG``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from PySide6.QtCore import Q_ARG, Q_RETURN_ARG, QMetaObject, Qt, QTimer
from PySide6.QtWidgets import QSystemTrayIcon

from gui.icons import ASSETS, app_icon
from gui.state import Notice

log = logging.getLogger(__name__)
SERVICE = "org.freedesktop.Notifications"
PATH = "/org/freedesktop/Notifications"
APP = "lakeshard"
DBUS_TIMEOUT_MS = 2000  # a notification service that does not answer in this long is not waited for


def _session_bus_known() -> bool:
    """Whether this session has a bus to ask: its address in the environment, or the per-user
    bus of systemd (``$XDG_RUNTIME_DIR/bus``)."""
    if os.environ.get("DBUS_SESSION_BUS_ADDRESS"):
        return True
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return runtime is not None and Path(runtime, "bus").exists()


class Notifier:
    """Shows :class:`Notice` s: through ``bus`` (a ``QDBusConnection``; None: the session bus)
    when the notification service is on it and ``use_dbus``, else through ``icon``'s balloon."""

    def __init__(self, icon: QSystemTrayIcon, bus: Any = None, *, use_dbus: bool = True) -> None:
        self.icon = icon
        self.bus = bus
        self.use_dbus = use_dbus
        self.sent: list[tuple[str, Notice]] = []  # (how, notice): 'dbus', 'tray' or 'none'
        self._iface: Any = None
        self._looked = False  # whether the service was looked for (once: it seldom comes and goes)
        self._ids: dict[str, int] = {}  # a notice's key -> the service's id of it
        self._latest: dict[int, int] = {}  # the service's id -> the serial of the latest notice shown under it
        self._serial = 0

    def service(self) -> Any:
        """The notification service's interface (None: there is none to talk to)."""
        if self._looked:
            return self._iface
        self._looked = True
        if not self.use_dbus:
            return None
        if self.bus is None and not _session_bus_known():
            return None  # (never let libdbus autolaunch a bus of its own for us)
        try:
            from PySide6.QtDBus import QDBusConnection, QDBusInterface
        except ImportError:  # a Qt build without D-Bus (Windows, macOS)
            return None
        bus = self.bus if self.bus is not None else QDBusConnection.sessionBus()
        if not bus.isConnected():
            return None
        reply = bus.interface().isServiceRegistered(SERVICE)
        if not reply.isValid() or not reply.value():
            return None
        iface = QDBusInterface(SERVICE, PATH, SERVICE, bus)
        iface.setTimeout(DBUS_TIMEOUT_MS)
        if not iface.isValid():
            log.info("the notification service does not answer: %s", iface.lastError().message())
            return None
        self._iface = iface
        return iface

    def show(self, n: Notice) -> str:
        """Show ``n``; how it went out: 'dbus', 'tray' or 'none' (no tray to show it in)."""
        how = "dbus" if self._by_dbus(n) else self._by_tray(n)
        self.sent.append((how, n))
        return how

    def _by_dbus(self, n: Notice) -> bool:
        iface = self.service()
        if iface is None:
            return False
        replaces = self._ids.get(n.key, 0) if n.key else 0
        icon = ASSETS / "lakeshard.svg"
        nid = QMetaObject.invokeMethod(
            iface,
            "Notify",
            Qt.ConnectionType.DirectConnection,
            Q_RETURN_ARG("uint"),
            Q_ARG(str, APP),
            Q_ARG("uint", replaces),
            Q_ARG(str, icon.as_uri() if icon.is_file() else ""),
            Q_ARG(str, n.title),
            Q_ARG(str, n.text),
            Q_ARG("QStringList", []),
            Q_ARG("QVariantMap", {}),
            Q_ARG(int, n.timeout_ms),
        )
        if iface.lastError().isValid() or not isinstance(nid, int) or nid <= 0:
            log.info("the notification service refused a notification: %s", iface.lastError().message())
            return False
        if n.key:
            self._ids[n.key] = nid
        self._serial += 1
        self._latest[nid] = serial = self._serial
        QTimer.singleShot(n.timeout_ms, lambda: self._expire(nid, serial))
        return True

    def _expire(self, nid: int, serial: int) -> None:
        """Close notice ``nid`` at its timeout, unless a later notice replaced it meanwhile."""
        if self._latest.get(nid) != serial or self._iface is None:
            return
        del self._latest[nid]
        self._ids = {k: v for k, v in self._ids.items() if v != nid}
        QMetaObject.invokeMethod(
            self._iface, "CloseNotification", Qt.ConnectionType.DirectConnection, Q_ARG("uint", nid)
        )

    def _by_tray(self, n: Notice) -> str:
        if not (self.icon.isVisible() and self.icon.supportsMessages()):
            return "none"
        self.icon.showMessage(n.title, n.text, app_icon(), n.timeout_ms)
        return "tray"
