"""A freedesktop notification service for tests: ``python -m tests.support.fake_notifications LOG``
serves ``org.freedesktop.Notifications`` on the session bus (``DBUS_SESSION_BUS_ADDRESS``) and
writes each call it gets to LOG as a line of JSON (``["notify", app, replaces_id, summary, body,
timeout_ms]`` or ``["close", id]``); "ready" once it holds the name. Its methods are typed as the
specification's (``Notify(s u s s s as a{sv} i) -> u``), so a caller that sends other types is
refused, as a real desktop's service refuses it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from PySide6.QtCore import ClassInfo, QCoreApplication, QObject, Slot
from PySide6.QtDBus import QDBusConnection


@ClassInfo({"D-Bus Interface": "org.freedesktop.Notifications"})
class Notifications(QObject):
    def __init__(self, log: Path) -> None:
        super().__init__()
        self.log = log
        self.last = 0

    def _write(self, entry: list[object]) -> None:
        with self.log.open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")

    @Slot(str, "uint", str, str, str, "QStringList", "QVariantMap", int, result="uint")
    def Notify(  # the specification's names
        self, app: str, replaces: int, icon: str, summary: str, body: str, actions: list[str], hints: dict, timeout: int
    ) -> int:
        nid = replaces or self.last + 1
        self.last = max(self.last, nid)
        self._write(["notify", app, replaces, summary, body, timeout])
        return nid

    @Slot("uint")
    def CloseNotification(self, nid: int) -> None:
        self._write(["close", nid])


def main() -> None:
    log = Path(sys.argv[1])
    app = QCoreApplication([])
    bus = QDBusConnection.sessionBus()
    service = Notifications(log)
    ok = bus.registerObject("/org/freedesktop/Notifications", service, QDBusConnection.RegisterOption.ExportAllSlots)
    if not ok or not bus.registerService("org.freedesktop.Notifications"):
        sys.exit(f"cannot serve org.freedesktop.Notifications: {bus.lastError().message()}")
    with log.open("a", encoding="utf-8") as f:
        f.write('"ready"\n')
    app.exec()


if __name__ == "__main__":
    main()
