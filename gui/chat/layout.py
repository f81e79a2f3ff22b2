"""The chat window's widgets and how they are laid out (no behaviour: :mod:`gui.chat.window` wires them).

On the left the conversations with New, Rename and Delete; on the right the model and
temperature, the system prompt (hidden until asked for), the banner that says why no answer
can come now (with a bar while the coordinator prepares), the transcript, the message box and
the row with the status line, Retry, Stop and Send.
"""

from __future__ import annotations

from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QMainWindow,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from gui.icons import app_icon


class ChatLayout(QMainWindow):
    """The window's widgets, built and placed; their signals are connected by the subclass."""

    input: QPlainTextEdit
    system: QPlainTextEdit

    def __init__(self) -> None:
        super().__init__()
        self.setWindowTitle("lakeshard chat")
        self.setWindowIcon(app_icon())
        self.resize(980, 680)
        split = QSplitter()
        split.addWidget(self._conversations_panel())
        split.addWidget(self._chat_panel())
        split.setStretchFactor(1, 3)
        split.setSizes([240, 740])
        self.setCentralWidget(split)

    def _conversations_panel(self) -> QWidget:
        left = QWidget()
        lv = QVBoxLayout(left)
        self.list = QListWidget()
        row = QHBoxLayout()
        self.new_btn = QPushButton("New")
        self.rename_btn = QPushButton("Rename")
        self.delete_btn = QPushButton("Delete")
        for b in (self.new_btn, self.rename_btn, self.delete_btn):
            row.addWidget(b)
        lv.addWidget(self.list)
        lv.addLayout(row)
        return left

    def _chat_panel(self) -> QWidget:
        right = QWidget()
        rv = QVBoxLayout(right)
        rv.addLayout(self._model_bar())
        self.system = QPlainTextEdit()
        self.system.setPlaceholderText("A system prompt for this conversation (optional)")
        self.system.setMaximumHeight(90)
        self.system.setVisible(False)
        rv.addWidget(self.system)
        self.banner = QLabel()
        self.banner.setWordWrap(True)
        self.banner.setStyleSheet("background:#fef3c7;color:#78350f;padding:6px;border-radius:4px")
        self.banner.setVisible(False)
        rv.addWidget(self.banner)
        self.prep_bar = QProgressBar()  # how far the coordinator's preparation is, under its banner
        self.prep_bar.setRange(0, 100)
        self.prep_bar.setTextVisible(False)
        self.prep_bar.setMaximumHeight(8)
        self.prep_bar.setVisible(False)
        rv.addWidget(self.prep_bar)
        self.transcript = QTextBrowser()
        self.transcript.setOpenLinks(False)
        rv.addWidget(self.transcript, 1)
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Ask the cluster… (Ctrl+Enter sends)")
        self.input.setMaximumHeight(120)
        rv.addWidget(self.input)
        rv.addLayout(self._send_row())
        return right

    def _model_bar(self) -> QHBoxLayout:
        bar = QHBoxLayout()
        bar.addWidget(QLabel("Model"))
        self.model = QComboBox()
        self.model.setMinimumWidth(200)
        bar.addWidget(self.model)
        bar.addWidget(QLabel("Temperature"))
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.1)
        self.temperature.setValue(0.0)
        bar.addWidget(self.temperature)
        bar.addStretch(1)
        self.system_btn = QPushButton("System prompt…")
        self.system_btn.setCheckable(True)
        bar.addWidget(self.system_btn)
        return bar

    def _send_row(self) -> QHBoxLayout:
        send_row = QHBoxLayout()
        self.status = QLabel("")
        self.status.setStyleSheet("color:#6b7280")
        send_row.addWidget(self.status, 1)
        self.retry_btn = QPushButton("Retry")
        self.retry_btn.setToolTip("Ask the last question again (the failed answer is replaced)")
        self.retry_btn.setVisible(False)
        send_row.addWidget(self.retry_btn)
        self.stop_btn = QPushButton("Stop")
        self.stop_btn.setEnabled(False)
        self.send_btn = QPushButton("Send")
        self.send_btn.setDefault(True)
        send_row.addWidget(self.stop_btn)
        send_row.addWidget(self.send_btn)
        return send_row
