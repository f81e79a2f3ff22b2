"""Opening a folder for the user (the logs): in the desktop's file manager, or, where none opens
it (no ``xdg-open``, a bare window manager, a remote session), a dialog that shows its path, to
select or copy with one click, so that the click is never silently lost."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QUrl
from PySide6.QtGui import QDesktopServices, QGuiApplication
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QHBoxLayout, QLabel, QLineEdit, QPushButton, QVBoxLayout


class FolderDialog(QDialog):
    """A folder's path, selectable, with *Copy* (to the clipboard) and *Close*."""

    def __init__(self, folder: str, what: str = "folder") -> None:
        super().__init__()
        self.setWindowTitle(f"lakeshard {what}")
        self.path = QLineEdit(folder)
        self.path.setReadOnly(True)
        self.path.setMinimumWidth(420)
        self.copy_btn = QPushButton("Copy")
        self.copy_btn.clicked.connect(self.copy)
        self.copied = QLabel("")
        row = QHBoxLayout()
        row.addWidget(self.path, 1)
        row.addWidget(self.copy_btn)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addWidget(QLabel(f"No file manager opened the {what}. It is here:"))
        lay.addLayout(row)
        lay.addWidget(self.copied)
        lay.addWidget(buttons)

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.path.text())
        self.copied.setText("copied to the clipboard")


def open_folder(folder: str | Path, opener: Callable[[QUrl], bool] | None = None) -> bool:
    """Open ``folder`` in the file manager; whether one opened it (``opener``: tests give theirs)."""
    return bool((opener or QDesktopServices.openUrl)(QUrl.fromLocalFile(str(folder))))
