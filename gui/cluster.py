"""Joining and inviting laptops: the tray's face of ``lakeshard cluster join|invite``.

Both dialogs go through the local agent's API (``/v1/cluster/join``, ``/v1/cluster/invite``),
so a failure is the agent's own one-line error, shown as it is. The requests run as asyncio
tasks on the Qt loop and report through Qt signals; nothing waits on the GUI thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from gui.client import ApiError, Client, Unreachable
from gui.icons import app_icon

EXPIRIES = ("1h", "24h", "7d", "30d")


def ask(title: str, text: str) -> bool:
    """A yes/no question (the tray and the node map take it as a parameter, so tests answer it)."""
    q = QMessageBox.question(None, title, text, QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No)
    return q == QMessageBox.StandardButton.Yes


class JoinDialog(QDialog):
    """Paste a token from ``Invite a laptop…`` (or ``lakeshard cluster invite``) and join."""

    joined = Signal(object)  # the agent's answer (dict): cluster id, node id, message
    failed = Signal(str)  # the agent's one-line error

    def __init__(self, client: Client) -> None:
        super().__init__()
        self.client = client
        self.setWindowTitle("Join a cluster")
        self.setWindowIcon(app_icon())
        self.resize(560, 180)
        intro = QLabel(
            "Paste the token made on a laptop of the cluster (its tray's <i>Invite a laptop…</i>, "
            "or <tt>lakeshard cluster invite</tt>). This laptop gets its own certificate; its links "
            "to the others are then encrypted and authenticated."
        )
        intro.setWordWrap(True)
        self.token = QLineEdit()
        self.token.setPlaceholderText("lsj1-…")
        self.token.returnPressed.connect(self.join)
        self.message = QLabel("")
        self.message.setWordWrap(True)
        self.message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.join_btn = QPushButton("Join")
        self.join_btn.setDefault(True)
        self.join_btn.clicked.connect(self.join)
        close = QPushButton("Close")
        close.clicked.connect(self.reject)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.join_btn)
        buttons.addWidget(close)
        lay = QVBoxLayout(self)
        lay.addWidget(intro)
        lay.addWidget(self.token)
        lay.addWidget(self.message)
        lay.addLayout(buttons)
        self.failed.connect(self._on_failed)
        self.joined.connect(self._on_joined)
        self._task: asyncio.Task[Any] | None = None

    def join(self) -> None:
        token = self.token.text().strip()
        if not token:
            self.message.setText("paste a token first")
            return
        self.join_btn.setEnabled(False)
        self.message.setText("joining… (this laptop asks the cluster member the token names)")
        self._task = asyncio.ensure_future(self._join(token))

    async def _join(self, token: str) -> None:
        try:
            r = await self.client.cluster_join(token)
        except (ApiError, Unreachable) as e:
            self.failed.emit(str(e))
            return
        self.joined.emit(r)

    def _on_failed(self, error: str) -> None:
        self.message.setText(f"not joined: {error}")
        self.join_btn.setEnabled(True)

    def _on_joined(self, r: dict[str, Any]) -> None:
        self.join_btn.setEnabled(True)
        if r.get("agent_error"):
            self.message.setText(f"{r.get('message')}, but the agent could not start as a member: {r['agent_error']}")
            return
        self.message.setText(str(r.get("message") or "joined"))
        self.accept()


class InviteDialog(QDialog):
    """Make a join token for another laptop (on the laptop that holds the cluster's CA)."""

    made = Signal(object)  # the agent's answer (dict): token, expires_s, uses, address, message
    failed = Signal(str)

    def __init__(self, client: Client) -> None:
        super().__init__()
        self.client = client
        self.setWindowTitle("Invite a laptop")
        self.setWindowIcon(app_icon())
        self.resize(620, 240)
        form = QWidget()
        f = QFormLayout(form)
        self.expires = QComboBox()
        self.expires.setEditable(True)  # any duration the agent takes: 30m, 12h, 2w
        self.expires.addItems(EXPIRIES)
        self.expires.setCurrentText("24h")
        self.uses = QSpinBox()
        self.uses.setRange(1, 1000)
        self.uses.setValue(1)
        self.address = QLineEdit()
        self.address.setPlaceholderText("default: this laptop's LAN address and data port")
        f.addRow("Valid for", self.expires)
        f.addRow("Laptops it may add", self.uses)
        f.addRow("Reached at", self.address)
        self.token = QLineEdit()
        self.token.setReadOnly(True)
        self.token.setPlaceholderText("the token appears here")
        self.make_btn = QPushButton("Make a token")
        self.make_btn.clicked.connect(self.make)
        self.copy_btn = QPushButton("Copy")
        self.copy_btn.setEnabled(False)
        self.copy_btn.clicked.connect(self.copy)
        row = QHBoxLayout()
        row.addWidget(self.token, 1)
        row.addWidget(self.copy_btn)
        self.message = QLabel("On the other laptop: its tray's Join a cluster…, or lakeshard cluster join TOKEN.")
        self.message.setWordWrap(True)
        close = QPushButton("Close")
        close.clicked.connect(self.reject)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.make_btn)
        buttons.addWidget(close)
        lay = QVBoxLayout(self)
        lay.addWidget(form)
        lay.addLayout(row)
        lay.addWidget(self.message)
        lay.addLayout(buttons)
        self.made.connect(self._on_made)
        self.failed.connect(self._on_failed)
        self._task: asyncio.Task[Any] | None = None

    def make(self) -> None:
        self.make_btn.setEnabled(False)
        self.message.setText("making a token…")
        args = (self.expires.currentText().strip(), self.uses.value(), self.address.text().strip() or None)
        self._task = asyncio.ensure_future(self._make(*args))

    async def _make(self, expires: str, uses: int, address: str | None) -> None:
        try:
            r = await self.client.cluster_invite(expires, uses, address)
        except (ApiError, Unreachable) as e:
            self.failed.emit(str(e))
            return
        self.made.emit(r)

    def _on_made(self, r: dict[str, Any]) -> None:
        self.token.setText(str(r["token"]))
        self.copy_btn.setEnabled(True)
        self.make_btn.setEnabled(True)
        self.message.setText(str(r.get("message") or ""))

    def _on_failed(self, error: str) -> None:
        self.token.clear()
        self.copy_btn.setEnabled(False)
        self.make_btn.setEnabled(True)
        self.message.setText(f"no token: {error}")

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.token.text())
        self.message.setText("copied: paste it into the other laptop's Join a cluster…")
