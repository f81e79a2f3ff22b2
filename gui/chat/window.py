"""The chat window: conversations with the cluster through the coordinator's OpenAI API.

Its widgets are laid out in :mod:`gui.chat.layout`; conversations (with their system prompt,
model and unsent draft) live in SQLite (:mod:`gui.chat.store`); answers stream in through
:mod:`gui.chat.answer`, and Stop cancels the generation on the cluster. When no coordinator
answers, the window says so, keeps the message in the box and sends it once one does; an
answer that breaks off keeps its text, marked "interrupted", and Retry asks again.

What can be done with the last turn (Retry, Regenerate, Edit, Continue) is
:mod:`gui.chat.turn`'s; the search across conversations (Ctrl+F) :mod:`gui.chat.search`'s;
Export saves a conversation as Markdown (:mod:`gui.chat.export`). Its colours come from the
palette, light or dark as the system's (:mod:`gui.chat.theme`), and change with it. Shortcuts:
Ctrl+Enter sends, Esc stops, Ctrl+N starts a conversation, Ctrl+F searches, Ctrl+Shift+C copies
the last code block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from PySide6.QtCore import QEvent, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import QInputDialog, QListWidgetItem, QMessageBox

from agent.protocol.cluster_view import ClusterView, Preparation
from agent.protocol.events import Event
from gui.chat import export, preparing
from gui.chat.answer import AnswerStream, Ended
from gui.chat.layout import ChatLayout
from gui.chat.search import ConversationSearch
from gui.chat.store import Store
from gui.chat.theme import Theme, from_palette
from gui.chat.transcript import transcript_html
from gui.chat.turn import LastTurn
from gui.client import ApiError, BadAddress, Client, NotServing, Unreachable

log = logging.getLogger(__name__)
RETRY_S = 2.0
RENDER_EVERY_S = 0.05  # re-render a streaming answer at most this often


class ChatWindow(ChatLayout):
    """What the chat's widgets do: conversations (kept in :mod:`gui.chat.store`), the answer
    being streamed (:class:`~gui.chat.answer.AnswerStream`) and whether a coordinator answers."""

    answered = Signal(int)  # a message id, once its answer is complete (or stopped)
    chunk = Signal(str)  # each piece of an answer as it streams in

    def __init__(self, client: Client, store: Store | None = None, names: dict[str, str] | None = None) -> None:
        super().__init__()
        self.client = client
        self.store = store or Store()
        self.names = names if names is not None else {}
        self.cluster: ClusterView | None = None  # the cluster as the tray's event stream tells it
        self.answers = AnswerStream(client, self.store, self.names, ring=self._serving_ring)
        self.conversation: int | None = None
        self.turn = LastTurn(self)  # Retry, Regenerate, Edit, Continue (and the turn being edited)
        self.finder = ConversationSearch(self)
        self.theme: Theme = from_palette(self.palette())
        self.blocks: list[str] = []
        self.reachable: bool | None = None
        self.pending_send = False  # the user pressed Send while no coordinator answered
        self._last_render = 0.0
        self._probe: asyncio.Task[None] | None = None
        self._stopped = False
        self.not_serving: str | None = None  # a coordinator answers, but not yet: why (its step)
        self.preparing: Preparation | None = None  # its preparation, as the event stream tells it
        self._following: asyncio.Task[None] | None = None  # the event stream, while it prepares
        self._wake = asyncio.Event()  # ask for the models now (the stream said: ready)
        self._connect()
        self._apply_theme()
        self._load_conversations()
        self._draft_timer = QTimer(self)
        self._draft_timer.setSingleShot(True)
        self._draft_timer.timeout.connect(self._save_draft)
        self.input.textChanged.connect(lambda: self._draft_timer.start(400))
        self._probe = asyncio.ensure_future(self._watch_coordinator())

    @property
    def streaming(self) -> asyncio.Task[None] | None:
        """The answer being streamed, while it is."""
        return self.answers.task

    @property
    def live(self) -> dict[str, Any] | None:
        """The answer being streamed: message id, text, stats."""
        return self.answers.live

    def _connect(self) -> None:
        self.list.currentItemChanged.connect(self._picked)
        self.new_btn.clicked.connect(self.new_conversation)
        self.rename_btn.clicked.connect(self._ask_rename)
        self.delete_btn.clicked.connect(self._ask_delete)
        self.export_btn.clicked.connect(self._ask_export)
        self.model.currentTextChanged.connect(self._model_picked)
        self.system_btn.toggled.connect(lambda on: self.system.setVisible(on))
        self.system.textChanged.connect(self._system_changed)
        self.transcript.anchorClicked.connect(self._link)
        self.stop_btn.clicked.connect(self.stop)
        self.send_btn.clicked.connect(self.send)
        for keys, slot in (
            ("Ctrl+Return", self.send),
            ("Esc", self._escape),
            ("Ctrl+N", self.new_conversation),
            ("Ctrl+F", self.finder.focus),
            ("Ctrl+Shift+C", self.copy_last_code),
        ):
            QShortcut(QKeySequence(keys), self, slot)
        a = self.answers
        a.noted.connect(self._noted)
        a.answering.connect(lambda: self.status.setText("answering…"))
        a.chunk.connect(self.chunk)
        a.progressed.connect(self._progressed)
        a.ended.connect(self._ended)
        a.idle.connect(self._idle)

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
        self.finder.refilter()
        self.open_conversation(target)

    def _picked(self, item: QListWidgetItem | None, _prev: Any = None) -> None:
        if item is not None:
            self.open_conversation(int(item.data(Qt.ItemDataRole.UserRole)))
            self.finder.show_words()

    def open_conversation(self, cid: int) -> None:
        if cid == self.conversation:
            return
        self._save_draft()
        self.conversation = cid
        self.turn.editing = None
        if self.streaming is None:  # (what the status line said was about the last one)
            self.status.setText("")
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
        """Start a conversation (Ctrl+N): it opens, with nothing said of the last one."""
        self.search.clear()  # (a search would hide it)
        cid = self.store.create(model=self.model.currentText() or None)
        self._load_conversations(select=cid)
        return cid

    def _ask_export(self) -> None:
        """Export: save the conversation shown as Markdown, where the user picks."""
        if self.conversation is None:
            return
        done = export.save_dialog(self, self.store, self.conversation, self.names)
        if done is not None:
            self.status.setText(f"saved {done.name}")

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
        offer = self.turn.offers()
        page, self.blocks = transcript_html(msgs, self.live, self.names, self.theme, offer)
        self.turn.show(offer)
        bar = self.transcript.verticalScrollBar()
        at_end = to_end or bar.value() >= bar.maximum() - 4
        self.transcript.setHtml(page)
        if at_end:
            bar.setValue(bar.maximum())
        self._last_render = time.monotonic()

    def _link(self, url: QUrl) -> None:
        s = url.toString()
        if s.endswith(":") and s[:-1] in self.turn.actions:
            self.turn.actions[s[:-1]]()
            return
        if s.startswith("copy:"):
            self._copy(int(s[5:]) if s[5:].isdigit() else -1)

    def _copy(self, i: int) -> None:
        if 0 <= i < len(self.blocks):
            QGuiApplication.clipboard().setText(self.blocks[i])
            self.status.setText("code copied")

    def copy_last_code(self) -> None:
        """Copy the last code block of the conversation shown (Ctrl+Shift+C)."""
        if self.blocks:
            self._copy(len(self.blocks) - 1)
        else:
            self.status.setText("no code block to copy")

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
        self.input.blockSignals(True)
        self.input.clear()
        self.input.blockSignals(False)
        self.turn.send(cid, text, self.model.currentText() or None, self.temperature.value())
        self.started()
        self._load_conversations(select=cid)  # (it moves to the top of the list)

    def _escape(self) -> None:
        """Esc: stop the answer; with none streaming, leave an edit be (the box is emptied) or
        clear the search being typed."""
        if self.streaming is not None:
            self.stop()
        elif not self.finder.clear_typed():
            self.turn.leave_edit()

    def started(self) -> None:
        """An answer is on its way (asked, asked again, or going on): the window says so."""
        self.send_btn.setEnabled(False)
        self.stop_btn.setEnabled(True)
        self.status.setText("waiting for the first token…")
        self.redraw(to_end=True)

    def _noted(self, note: str) -> None:
        self.status.setText(note)
        self.redraw()

    def _progressed(self) -> None:
        if time.monotonic() - self._last_render > RENDER_EVERY_S:
            self.redraw()

    def _ended(self, end: Ended) -> None:
        """Say how the answer ended (what came is in the store already)."""
        if isinstance(end.error, Unreachable):
            self.banner.setProperty("bad_address", isinstance(end.error, BadAddress))
            self.not_serving = str(end.error) if isinstance(end.error, NotServing) else None
        if end.unsent:  # the question is back in the box, to be sent once a coordinator answers
            if self.conversation == end.conversation:
                self.input.setPlainText(end.question)
            self.reachable = False
            self.pending_send = True
            self._say_unreachable(end.stats.get("error", ""))
            self._check_coordinator()
            self.status.setText("not sent: no coordinator answers")
            return
        if end.outcome in ("interrupted", "unreachable"):
            self._check_coordinator()  # if it is gone, the banner says so
        if end.outcome == "interrupted":
            self.status.setText("The answer was interrupted. Retry asks again.")
        elif end.outcome in ("error", "unreachable"):
            self.status.setText(f"error: {end.stats.get('error', '')}")
        elif end.outcome == "stopped":
            self.status.setText("stopped")
        elif end.stats.get("finish") == "length":
            self.status.setText("stopped: length (the token limit). Continue goes on.")
        else:
            self.status.setText("")

    def _idle(self, mid: int) -> None:
        """However the answer ended, the window is ready for the next."""
        self.send_btn.setEnabled(True)
        self.stop_btn.setEnabled(False)
        self.redraw()
        self.answered.emit(mid)

    def _check_coordinator(self) -> None:
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._watch_coordinator())

    def stop(self) -> None:
        """Stop the answer: the request is closed, and the cluster cancels the generation."""
        self.answers.stop()

    # -- the coordinator's reachability ----------------------------------------------------------
    def _say_unreachable(self, why: str) -> None:
        self.banner.setProperty("why", why)
        if self.not_serving is not None:  # a coordinator answers: it prepares the model
            self._say_preparing()
            return
        self._banner_kind(preparing.WARN)
        self.prep_bar.setVisible(False)
        text = preparing.unreachable(why, bool(self.banner.property("bad_address")), self.pending_send, RETRY_S)
        self.banner.setText(text)
        self.banner.setVisible(True)

    def _say_preparing(self) -> None:
        """The coordinator prepares its model: the step it is at (live, from its event stream)."""
        text, kind, pct = preparing.banner(self.preparing, self.not_serving, self.pending_send)
        self.banner.setText(text)
        self._banner_kind(kind)
        self.banner.setVisible(True)
        self.prep_bar.setVisible(pct is not None)
        self.prep_bar.setValue(round(pct or 0))
        p = self.preparing
        self.model.setPlaceholderText(p.model if p is not None and p.step != "failed" else "")  # (greyed: not yet)

    def _banner_kind(self, kind: str) -> None:
        self.banner.setProperty("kind", kind)
        self.banner.setStyleSheet(self.theme.banner_style(kind))

    # -- the cluster (from the tray's event stream) and the palette ------------------------------
    def on_cluster_event(self, update: tuple[Event, ClusterView | None]) -> None:
        """An event of the cluster's stream and the picture after it (the tray's ``cluster_event``):
        the nodes' names, and the plan serving now, for the answer being streamed."""
        self.cluster = update[1]
        if self.cluster is None:
            return
        self.names.update({n.node: n.name for n in self.cluster.nodes})
        self.answers.saw_plan(self._serving_ring())

    def _serving_ring(self) -> tuple[str, ...]:
        """The nodes computing answers now, in stage order (none while it re-plans or is not known)."""
        c = self.cluster
        return c.ring if c is not None and c.service == "serving" else ()

    def _apply_theme(self) -> None:
        """Colours from the palette: the status line, the banner, links; the transcript is redrawn."""
        self.theme = from_palette(self.palette())
        t = self.theme
        self.status.setStyleSheet(f"color:{t.window_muted}")
        self.banner.setStyleSheet(t.banner_style(str(self.banner.property("kind") or preparing.INFO)))
        self.transcript.document().setDefaultStyleSheet(f"a {{ color: {t.link}; }}")
        self.redraw()

    def changeEvent(self, e: QEvent) -> None:
        """The system's palette changed (dark mode on or off): redraw in its colours."""
        super().changeEvent(e)
        changed = e.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange)
        if not changed or getattr(self, "theme", None) is None or getattr(self, "_stopped", True):
            return
        if from_palette(self.palette()) != self.theme:
            self._apply_theme()

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
