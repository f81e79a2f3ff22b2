"""The chat window's widgets and how they are laid out (no behaviour: :mod:`gui.chat.window` wires them).

On the left the search box over the conversations, the conversations, and New, Rename, Delete
and Export; on the right the model and temperature, the system prompt (hidden until asked for),
the banner that says why no answer can come now (with a bar while the coordinator prepares),
the transcript, the message box and the row with the status line, what can be done with the
last turn (Retry, Continue, Regenerate, Edit), Stop and Send. Only colours from the palette.
"""

from __future__ import annotations

from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
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
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search conversations (Ctrl+F)")
        self.search.setClearButtonEnabled(True)
        lv.addWidget(self.search)
        self.list = QListWidget()
        row = QHBoxLayout()
        self.new_btn = QPushButton("New")
        self.new_btn.setToolTip("A new conversation (Ctrl+N)")
        self.rename_btn = QPushButton("Rename")
        self.delete_btn = QPushButton("Delete")
        self.export_btn = QPushButton("Export…")
        self.export_btn.setToolTip("Save this conversation as a Markdown file")
        for b in (self.new_btn, self.rename_btn, self.delete_btn, self.export_btn):
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
        self.input.setPlaceholderText("Ask the cluster… (Ctrl+Enter sends, Esc stops)")
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
        send_row.addWidget(self.status, 1)
        self.retry_btn = QPushButton("Retry")
        self.retry_btn.setToolTip("Ask the last question again (the failed answer is replaced)")
        self.continue_btn = QPushButton("Continue")
        self.continue_btn.setToolTip("Go on with the answer the token limit cut (it joins the same answer)")
        self.regenerate_btn = QPushButton("Regenerate")
        self.regenerate_btn.setToolTip("Ask the last question again: a new answer replaces this one")
        self.edit_btn = QPushButton("Edit")
        self.edit_btn.setToolTip("Put your last message back in the box: sending it replaces that turn")
        for b in (self.retry_btn, self.continue_btn, self.regenerate_btn, self.edit_btn):
            b.setVisible(False)
            send_row.addWidget(b)
        self.stop_btn = QPushButton("Stop")
        self.stop_btn.setToolTip("Stop the answer (Esc)")
        self.stop_btn.setEnabled(False)
        self.send_btn = QPushButton("Send")
        self.send_btn.setDefault(True)
        send_row.addWidget(self.stop_btn)
        send_row.addWidget(self.send_btn)
        return send_row
