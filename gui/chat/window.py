"""The chat window: conversations with the cluster through the coordinator's OpenAI API.

Answers stream in as they are generated; Stop closes the request, which cancels the
generation on the cluster. Conversations (with their system prompt, model and unsent draft)
live in SQLite (:mod:`gui.chat.store`). When no coordinator answers, the window says so, keeps
the message in the box and sends it once one does. An answer that breaks off keeps its text,
is marked "interrupted" with the reason, and can be asked again (Retry); whatever goes wrong,
the answer ends and Send and Stop work again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from PySide6.QtCore import Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMessageBox,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from agent.protocol.cluster_view import ClusterView, Preparation
from gui.chat import preparing
from gui.chat.store import Store
from gui.chat.transcript import failed, transcript_html
from gui.client import ApiError, BadAddress, Client, Interrupted, NotServing, Unreachable
from gui.icons import app_icon

log = logging.getLogger(__name__)
RETRY_S = 2.0
RENDER_EVERY_S = 0.05  # re-render a streaming answer at most this often


class ChatWindow(QMainWindow):
    answered = Signal(int)  # a message id, once its answer is complete (or stopped)
    chunk = Signal(str)  # each piece of an answer as it streams in
    input: QPlainTextEdit
    system: QPlainTextEdit

    def __init__(self, client: Client, store: Store | None = None, names: dict[str, str] | None = None) -> None:
        super().__init__()
        self.client = client
        self.store = store or Store()
        self.names = names if names is not None else {}
        self.conversation: int | None = None
        self.blocks: list[str] = []
        self.reachable: bool | None = None
        self.pending_send = False  # the user pressed Send while no coordinator answered
        self.streaming: asyncio.Task[None] | None = None
        self.live: dict[str, Any] | None = None  # the answer being streamed: message id, text, stats
        self._last_render = 0.0
        self._probe: asyncio.Task[None] | None = None
        self._stopped = False
        self.not_serving: str | None = None  # a coordinator answers, but not yet: why (its step)
        self.preparing: Preparation | None = None  # its preparation, as the event stream tells it
        self._following: asyncio.Task[None] | None = None  # the event stream, while it prepares
        self._wake = asyncio.Event()  # ask for the models now (the stream said: ready)
        self.setWindowTitle("lakeshard chat")
        self.setWindowIcon(app_icon())
        self.resize(980, 680)
        self._build()
        self._load_conversations()
        self._draft_timer = QTimer(self)
        self._draft_timer.setSingleShot(True)
        self._draft_timer.timeout.connect(self._save_draft)
        self.input.textChanged.connect(lambda: self._draft_timer.start(400))
        self._probe = asyncio.ensure_future(self._watch_coordinator())

    # -- layout ----------------------------------------------------------------------------------
    def _build(self) -> None:
        left = QWidget()
        lv = QVBoxLayout(left)
        self.list = QListWidget()
        self.list.currentItemChanged.connect(self._picked)
        row = QHBoxLayout()
        self.new_btn = QPushButton("New")
        self.new_btn.clicked.connect(self.new_conversation)
        self.rename_btn = QPushButton("Rename")
        self.rename_btn.clicked.connect(self._ask_rename)
        self.delete_btn = QPushButton("Delete")
        self.delete_btn.clicked.connect(self._ask_delete)
        for b in (self.new_btn, self.rename_btn, self.delete_btn):
            row.addWidget(b)
        lv.addWidget(self.list)
        lv.addLayout(row)

        right = QWidget()
        rv = QVBoxLayout(right)
        bar = QHBoxLayout()
        bar.addWidget(QLabel("Model"))
        self.model = QComboBox()
        self.model.setMinimumWidth(200)
        self.model.currentTextChanged.connect(self._model_picked)
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
        self.system_btn.toggled.connect(lambda on: self.system.setVisible(on))
        bar.addWidget(self.system_btn)
        rv.addLayout(bar)
        self.system = QPlainTextEdit()
        self.system.setPlaceholderText("A system prompt for this conversation (optional)")
        self.system.setMaximumHeight(90)
        self.system.setVisible(False)
        self.system.textChanged.connect(self._system_changed)
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
        self.transcript.anchorClicked.connect(self._link)
        rv.addWidget(self.transcript, 1)
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Ask the cluster… (Ctrl+Enter sends)")
        self.input.setMaximumHeight(120)
        rv.addWidget(self.input)
        send_row = QHBoxLayout()
        self.status = QLabel("")
        self.status.setStyleSheet("color:#6b7280")
        send_row.addWidget(self.status, 1)
        self.retry_btn = QPushButton("Retry")
        self.retry_btn.setToolTip("Ask the last question again (the failed answer is replaced)")
        self.retry_btn.clicked.connect(self.retry)
        self.retry_btn.setVisible(False)
        send_row.addWidget(self.retry_btn)
        self.stop_btn = QPushButton("Stop")
        self.stop_btn.clicked.connect(self.stop)
        self.stop_btn.setEnabled(False)
        self.send_btn = QPushButton("Send")
        self.send_btn.setDefault(True)
        self.send_btn.clicked.connect(self.send)
        send_row.addWidget(self.stop_btn)
        send_row.addWidget(self.send_btn)
        rv.addLayout(send_row)
        QShortcut(QKeySequence("Ctrl+Return"), self, self.send)

        split = QSplitter()
        split.addWidget(left)
        split.addWidget(right)
        split.setStretchFactor(1, 3)
        split.setSizes([240, 740])
        self.setCentralWidget(split)

    # -- conversations ---------------------------------------------------------------------------
    def _load_conversations(self, select: int | None = None) -> None:
        convs = self.store.conversations()
        if not convs:
            self.store.create()
            convs = self.store.conversations()
        self.list.blockSignals(True)
        self.list.clear()
        for c in convs:
            it = QListWidgetItem(c.title)
            it.setData(Qt.ItemDataRole.UserRole, c.id)
            self.list.addItem(it)
        self.list.blockSignals(False)
        ids = [c.id for c in convs]
        target = select if select in ids else (self.conversation if self.conversation in ids else ids[0])
        self.list.setCurrentRow(ids.index(target))
        self.open_conversation(target)

    def _picked(self, item: QListWidgetItem | None, _prev: Any = None) -> None:
        if item is not None:
            self.open_conversation(int(item.data(Qt.ItemDataRole.UserRole)))

    def open_conversation(self, cid: int) -> None:
        if cid == self.conversation:
            return
        self._save_draft()
        self.conversation = cid
        conv = self.store.get(cid)
        assert conv is not None
        self.system.blockSignals(True)
        self.system.setPlainText(conv.system_prompt)
        self.system.blockSignals(False)
        self.system_btn.setChecked(bool(conv.system_prompt))
        self.input.blockSignals(True)
        self.input.setPlainText(conv.draft)
        self.input.blockSignals(False)
        if conv.model and self.model.findText(conv.model) >= 0:
            self.model.setCurrentText(conv.model)
        self.redraw(to_end=True)

    def new_conversation(self) -> int:
        cid = self.store.create(model=self.model.currentText() or None)
        self._load_conversations(select=cid)
        return cid

    def rename(self, cid: int, title: str) -> None:
        self.store.rename(cid, title)
        self._load_conversations(select=cid)

    def delete(self, cid: int) -> None:
        if self.live is not None and self.conversation == cid:
            self.stop()
        self.store.delete(cid)
        if self.conversation == cid:
            self.conversation = None
        self._load_conversations()

    def _ask_rename(self) -> None:
        if self.conversation is None:
            return
        conv = self.store.get(self.conversation)
        title, ok = QInputDialog.getText(self, "Rename conversation", "Title", text=conv.title if conv else "")
        if ok:
            self.rename(self.conversation, title)

    def _ask_delete(self) -> None:
        if self.conversation is None:
            return
        if QMessageBox.question(self, "Delete conversation", "Delete this conversation?") == (
            QMessageBox.StandardButton.Yes
        ):
            self.delete(self.conversation)

    def _save_draft(self) -> None:
        if self._stopped:
            return
        if self.conversation is not None and self.store.get(self.conversation) is not None:
            self.store.set_draft(self.conversation, self.input.toPlainText())

    def _system_changed(self) -> None:
        if self.conversation is not None:
            self.store.set_system_prompt(self.conversation, self.system.toPlainText())

    def _model_picked(self, name: str) -> None:
        if self.conversation is not None and name:
            self.store.set_model(self.conversation, name)

    # -- the transcript --------------------------------------------------------------------------
    def redraw(self, to_end: bool = False) -> None:
        """Show the conversation; keep following its end if the reader was there (``to_end``: go
        there, as when a conversation opens or a question goes out)."""
        if self.conversation is None:
            return
        msgs = self.store.messages(self.conversation)
        page, self.blocks = transcript_html(msgs, self.live, self.names, can_retry=self.streaming is None)
        self.retry_btn.setVisible(self.can_retry())
        bar = self.transcript.verticalScrollBar()
        at_end = to_end or bar.value() >= bar.maximum() - 4
        self.transcript.setHtml(page)
        if at_end:
            bar.setValue(bar.maximum())
        self._last_render = time.monotonic()

    def _link(self, url: QUrl) -> None:
        s = url.toString()
        if s.startswith("retry:"):
            self.retry()
            return
        if s.startswith("copy:"):
            i = int(s[5:]) if s[5:].isdigit() else -1
            if 0 <= i < len(self.blocks):
                QGuiApplication.clipboard().setText(self.blocks[i])
                self.status.setText("code copied")

    # -- sending ---------------------------------------------------------------------------------
    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self.conversation is None or self.streaming is not None:
            return
        if self.reachable is False:
            self.pending_send = True
            self._say_unreachable(self.banner.property("why") or "no coordinator answers")
            return
        self.pending_send = False
        cid = self.conversation
        self.store.add(cid, "user", text)
        self.input.blockSignals(True)
        self.input.clear()
        self.input.blockSignals(False)
        self.store.set_draft(cid, "")
        mid = self.store.add(cid, "assistant", "")
        self._start(cid, mid, text)
        self._load_conversations(select=cid)  # (it moves to the top of the list)

    def can_retry(self) -> bool:
        """Whether the shown conversation ends in a failed answer that Retry can ask again."""
        if self.conversation is None or self.streaming is not None:
            return False
        msgs = self.store.messages(self.conversation)[-2:]
        return [m.role for m in msgs] == ["user", "assistant"] and failed(msgs[1].stats)

    def retry(self) -> None:
        """Ask the last question again; the new answer replaces the failed one, as chat apps'
        "regenerate" does (if the new try brings no text, the failed one stays)."""
        if not self.can_retry():
            return
        assert self.conversation is not None
        question, answer = self.store.messages(self.conversation)[-2:]
        self.store.update(answer.id, "", {})  # (so that it is not part of the question's history)
        self._start(self.conversation, answer.id, question.content, previous=(answer.content, answer.stats))

    def _start(self, cid: int, mid: int, question: str, previous: tuple[str, dict[str, Any]] | None = None) -> None:
        self.live = {"id": mid, "text": "", "stats": {}, "conversation": cid, "question": question, "note": None}
        self.live.update(t0=time.perf_counter(), first=None, pieces=0, previous=previous)
        self.send_btn.setEnabled(False)
        self.stop_btn.setEnabled(True)
        self.status.setText("waiting for the first token…")
        self.streaming = asyncio.ensure_future(self._answer(cid, mid, question))
        self.redraw(to_end=True)

    async def _answer(self, cid: int, mid: int, question: str) -> None:
        """Stream one answer into the store; however it ends, the window is ready for the next."""
        live = self.live
        assert live is not None
        stats = live["stats"]
        outcome = "error"
        try:
            await self._stream(cid, live)
            outcome = "done"
        except asyncio.CancelledError:
            outcome = "stopped"
        except Unreachable as e:
            outcome = "unreachable"
            stats["error"] = str(e)
            self.banner.setProperty("bad_address", isinstance(e, BadAddress))
            self.not_serving = str(e) if isinstance(e, NotServing) else None
        except Interrupted as e:
            outcome = "interrupted"
            stats["interrupted"] = str(e)
            log.info("the answer to %r was interrupted: %s (%s)", question[:60], e, e.detail)
        except ApiError as e:
            stats["error"] = str(e)
        except Exception as e:  # a case nobody foresaw: the answer still ends, and says why
            log.exception("the answer to %r failed", question[:60])
            stats["error"] = f"unexpected error: {e!r}"
        # (only the loop's own end, GeneratorExit, gets past the handlers above: no window to reset then)
        try:
            self._settle(cid, mid, question, outcome, live)
        finally:
            self.live = None
            self.streaming = None
            self.send_btn.setEnabled(True)
            self.stop_btn.setEnabled(False)
            self.redraw()
        self.answered.emit(mid)

    async def _stream(self, cid: int, live: dict[str, Any]) -> None:
        history = self.store.history(cid)  # (the empty answer being written is left out)
        stats = live["stats"]
        async for ch in self.client.chat(
            history, model=self.model.currentText() or None, temperature=self.temperature.value()
        ):
            if ch.note:  # the cluster says why the answer waits (the gateway splicing in the rest)
                live["note"] = ch.note
                self.status.setText(ch.note)
                self.redraw()
            if ch.text:
                live["pieces"] += 1
                if live["first"] is None or live["note"]:
                    live["first"] = live["first"] or time.perf_counter()
                    live["note"] = None
                    self.status.setText("answering…")
                live["text"] += ch.text
                self.chunk.emit(ch.text)
            if ch.stats:
                stats["nodes"] = ch.stats.get("nodes") or []
                stats["tokens"] = ch.stats.get("completion_tokens")
            if time.monotonic() - self._last_render > RENDER_EVERY_S:
                self.redraw()

    def _settle(self, cid: int, mid: int, question: str, outcome: str, live: dict[str, Any]) -> None:
        """Keep what came (with its figures and how it ended) and say so in the status line."""
        stats = live["stats"]
        now, first = time.perf_counter(), live["first"]
        if first is not None:
            stats["ttft_s"] = round(first - live["t0"], 3)
            tokens = stats.get("tokens") or live["pieces"]
            if now > first and tokens > 1:
                stats["tok_s"] = round((tokens - 1) / (now - first), 1)
        if outcome == "stopped":
            stats["stopped"] = True
        text, previous = live["text"], live["previous"]
        if outcome == "unreachable" and not text and previous is None:
            # nothing came back: the question goes back into the box, to be sent again
            self.store.delete_message(mid)
            msgs = self.store.messages(cid)
            if msgs and msgs[-1].role == "user":
                self.store.delete_message(msgs[-1].id)
            if self.conversation == cid:
                self.input.setPlainText(question)
            self.store.set_draft(cid, question)
            self.reachable = False
            self.pending_send = True
            self._say_unreachable(stats.get("error", ""))
            self._check_coordinator()
            self.status.setText("not sent: no coordinator answers")
            return
        if previous is not None and not text:  # a retry that brought nothing: the failed answer stays
            text, stats = previous if outcome in ("done", "stopped") else (previous[0], stats)
        self.store.update(mid, text, stats)
        if outcome in ("interrupted", "unreachable"):
            self._check_coordinator()  # if it is gone, the banner says so
        if outcome == "interrupted":
            self.status.setText("The answer was interrupted. Retry asks again.")
        elif outcome in ("error", "unreachable"):
            self.status.setText(f"error: {stats.get('error', '')}")
        else:
            self.status.setText("stopped" if outcome == "stopped" else "")

    def _check_coordinator(self) -> None:
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._watch_coordinator())

    def stop(self) -> None:
        """Stop the answer: the request is closed, and the cluster cancels the generation."""
        if self.streaming is not None:
            self.streaming.cancel()

    # -- the coordinator's reachability ----------------------------------------------------------
    def _say_unreachable(self, why: str) -> None:
        self.banner.setProperty("why", why)
        if self.not_serving is not None:  # a coordinator answers: it prepares the model
            self._say_preparing()
            return
        self.banner.setStyleSheet(preparing.WARN)
        self.prep_bar.setVisible(False)
        if self.banner.property("bad_address"):  # (``why`` says what is wrong with it)
            extra = " Your message will be sent once it works." if self.pending_send else ""
            text = (
                f"{why[:1].upper()}{why[1:]}.\nCorrect it in Settings (Chat tab), or leave it blank to chat "
                f"through this laptop's agent.{extra}"
            )
        else:
            extra = " Your message will be sent when one answers." if self.pending_send else ""
            head = "No coordinator is reachable right now"
            if why.lower().startswith(head.lower()):  # the agent's own words say it: once is enough
                head, why = f"{head}{why[len(head) :].split(';')[0]}", ""
            text = f"{head}; retrying every {RETRY_S:.0f} s.{extra}" + (f"\n{why}" if why else "")
        self.banner.setText(text)
        self.banner.setVisible(True)

    def _say_preparing(self) -> None:
        """The coordinator prepares its model: the step it is at (live, from its event stream)."""
        text, style, pct = preparing.banner(self.preparing, self.not_serving, self.pending_send)
        self.banner.setText(text)
        self.banner.setStyleSheet(style)
        self.banner.setVisible(True)
        self.prep_bar.setVisible(pct is not None)
        self.prep_bar.setValue(round(pct or 0))
        p = self.preparing
        self.model.setPlaceholderText(p.model if p is not None and p.step != "failed" else "")  # (greyed: not yet)

    def _on_view(self, view: ClusterView | None) -> None:
        """The event stream's latest picture of the cluster (while the coordinator prepares)."""
        self.preparing = view.preparing if view is not None else None
        if self.reachable is not True and self.not_serving is not None:
            self._say_preparing()
        if self.preparing is not None and self.preparing.step == "ready":
            self._wake.set()  # its API answers now: no need to wait for the next try

    async def _watch_coordinator(self) -> None:
        """Until the coordinator answers: say so (while it prepares, the step it is at, from its
        event stream), keep trying; then fill the model list."""
        while True:
            try:
                models = await self.client.models()
            except Exception as e:  # whatever it is, say why and keep trying: never stop watching
                if not isinstance(e, Unreachable | ApiError):
                    log.exception("asking the coordinator for its models failed")
                self.reachable = False
                self.banner.setProperty("bad_address", isinstance(e, BadAddress))
                self.not_serving = str(e) if isinstance(e, NotServing) else None
                if self.not_serving is not None and (self._following is None or self._following.done()):
                    self._following = asyncio.ensure_future(preparing.async_follow(self.client, self._on_view))
                self._say_unreachable(str(e) or type(e).__name__)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), RETRY_S)
                continue
            self.reachable = True
            self.not_serving = None
            if self._following is not None:
                self._following.cancel()
                self._following = None
            self.banner.setVisible(False)
            self.prep_bar.setVisible(False)
            self.model.setPlaceholderText("")
            self._set_models(models)
            if self.pending_send and self.streaming is None:
                self.send()
            return

    def _set_models(self, models: list[str]) -> None:
        current = self.model.currentText()
        conv = self.store.get(self.conversation) if self.conversation is not None else None
        self.model.blockSignals(True)
        self.model.clear()
        self.model.addItems(models)
        want = (conv.model if conv else None) or current
        if want and want in models:
            self.model.setCurrentText(want)
        self.model.blockSignals(False)

    async def async_stop(self) -> None:
        """Save the draft, stop what runs (an answer being streamed is stopped); the store stays open."""
        self._save_draft()
        self._draft_timer.stop()
        self._stopped = True
        for t in (self.streaming, self._probe, self._following):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    def closeEvent(self, e: Any) -> None:
        self._save_draft()
        super().closeEvent(e)

    def showEvent(self, e: Any) -> None:
        """Opened (from the tray), a conversation shows its latest message: laid out only now,
        the transcript's scroll range is known only once the window is shown."""
        super().showEvent(e)
        QTimer.singleShot(0, self._to_end)

    def _to_end(self) -> None:
        bar = self.transcript.verticalScrollBar()
        bar.setValue(bar.maximum())
