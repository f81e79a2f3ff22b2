"""Icons for the tray states, from the SVG sources in ``assets/icons`` (one per state).

The state -> file mapping is data (:data:`ICON_FILES`); where the assets are missing (an
unusual install), a plain coloured disc stands in, so the tray never fails for want of a file.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QIcon, QPainter, QPixmap

from gui.state import TrayState

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "icons"
ICON_FILES = {s: f"{s.value}.svg" for s in TrayState}
FALLBACK_COLOURS = {
    TrayState.AVAILABLE: "#16a34a",
    TrayState.SERVING: "#15803d",
    TrayState.LIMITED: "#d97706",
    TrayState.PAUSED_USER: "#475569",
    TrayState.PAUSED_HEAT: "#ea580c",
    TrayState.COORDINATOR: "#2563eb",
    TrayState.ERROR: "#dc2626",
    TrayState.NO_CLUSTER: "#6b7280",
}
_cache: dict[TrayState, QIcon] = {}


def icon_path(state: TrayState) -> Path:
    return ASSETS / ICON_FILES[state]


def state_icon(state: TrayState) -> QIcon:
    if state not in _cache:
        p = icon_path(state)
        icon = QIcon(str(p)) if p.is_file() else QIcon()
        if icon.isNull():
            icon = _disc(FALLBACK_COLOURS[state])
        _cache[state] = icon
    return _cache[state]


def app_icon() -> QIcon:
    p = ASSETS / "lakeshard.svg"
    icon = QIcon(str(p)) if p.is_file() else QIcon()
    return icon if not icon.isNull() else _disc("#0e7490")


def _disc(colour: str) -> QIcon:
    pm = QPixmap(64, 64)
    pm.fill(Qt.GlobalColor.transparent)
    p = QPainter(pm)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    p.setBrush(QColor(colour))
    p.setPen(QColor("#111827"))
    p.drawEllipse(4, 4, 56, 56)
    p.end()
    return QIcon(pm)
