"""The answer being streamed: one at a time, into the conversation store, told through Qt signals.

:class:`AnswerStream` asks the cluster (through the coordinator's OpenAI API), appends what
streams in to the answer it is writing and keeps it in the store however it ends: done,
stopped (Stop cancels the request, which cancels the generation on the cluster), interrupted
(its text stays, marked with the reason, for Retry to ask again) or failed. An answer that
could not be sent at all (no coordinator answered, nothing came back) is taken out of the
store again, its question kept as the conversation's draft. The view (:mod:`gui.chat.window`)
follows it through the signals and reads ``live`` to draw the answer being written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QObject, Signal

from gui.chat.store import Store
from gui.chat.transcript import failed
from gui.client import ApiError, Client, Interrupted, Unreachable

log = logging.getLogger(__name__)


@dataclass
class Ended:
    """How an answer ended: ``outcome`` is done, stopped, interrupted, unreachable or error;
    ``error`` the exception that ended it (None when done or stopped); ``unsent``: nothing was
    sent (no coordinator answered): the question is out of the store, back in the draft."""

    conversation: int
    message: int
    question: str
    outcome: str
    stats: dict[str, Any] = field(default_factory=dict)
    error: Exception | None = None
    unsent: bool = False


class AnswerStream(QObject):
    """Streams one answer at a time into the store (on the GUI thread's event loop)."""

    noted = Signal(str)  # the cluster says why the answer waits
    answering = Signal()  # the answer's text starts (or goes on after a note)
    chunk = Signal(str)  # each piece of the answer as it streams in
    progressed = Signal()  # after each piece of the stream (the view redraws now and then)
    ended = Signal(object)  # an :class:`Ended`: what is kept is in the store
    idle = Signal(int)  # the message id: nothing streams any more (after ``ended``, whatever happened)

    def __init__(self, client: Client, store: Store) -> None:
        super().__init__()
        self.client, self.store = client, store
        self.task: asyncio.Task[None] | None = None
        self.live: dict[str, Any] | None = None  # the answer being streamed: message id, text, stats

    # -- asking --------------------------------------------------------------------------------
    def ask(self, cid: int, question: str, model: str | None, temperature: float) -> None:
        """Send ``question`` in conversation ``cid``: stored with the answer to come; the draft is spent."""
        self.store.add(cid, "user", question)
        self.store.set_draft(cid, "")
        mid = self.store.add(cid, "assistant", "")
        self._start(cid, mid, question, None, model, temperature)

    def can_retry(self, cid: int | None) -> bool:
        """Whether conversation ``cid`` ends in a failed answer that Retry can ask again."""
        if cid is None or self.task is not None:
            return False
        msgs = self.store.messages(cid)[-2:]
        return [m.role for m in msgs] == ["user", "assistant"] and failed(msgs[1].stats)

    def retry(self, cid: int, model: str | None, temperature: float) -> None:
        """Ask the last question again; the new answer replaces the failed one, as chat apps'
        "regenerate" does (if the new try brings no text, the failed one stays)."""
        question, answer = self.store.messages(cid)[-2:]
        self.store.update(answer.id, "", {})  # (so that it is not part of the question's history)
        self._start(cid, answer.id, question.content, (answer.content, answer.stats), model, temperature)

    def stop(self) -> None:
        """Stop the answer: the request is closed, and the cluster cancels the generation."""
        if self.task is not None:
            self.task.cancel()

    def _start(
        self,
        cid: int,
        mid: int,
        question: str,
        previous: tuple[str, dict[str, Any]] | None,
        model: str | None,
        temperature: float,
    ) -> None:
        self.live = {"id": mid, "text": "", "stats": {}, "conversation": cid, "question": question, "note": None}
        self.live.update(t0=time.perf_counter(), first=None, pieces=0, previous=previous)
        self.task = asyncio.ensure_future(self._answer(cid, mid, question, model, temperature))

    # -- streaming -----------------------------------------------------------------------------
    async def _answer(self, cid: int, mid: int, question: str, model: str | None, temperature: float) -> None:
        """Stream one answer into the store; however it ends, the stream is ready for the next."""
        live = self.live
        assert live is not None
        stats = live["stats"]
        error: Exception | None = None
        outcome = "error"
        try:
            await self._stream(cid, live, model, temperature)
            outcome = "done"
        except asyncio.CancelledError:
            outcome = "stopped"
        except Unreachable as e:
            outcome, error = "unreachable", e
            stats["error"] = str(e)
        except Interrupted as e:
            outcome, error = "interrupted", e
            stats["interrupted"] = str(e)
            log.info("the answer to %r was interrupted: %s (%s)", question[:60], e, e.detail)
        except ApiError as e:
            error = e
            stats["error"] = str(e)
        except Exception as e:  # a case nobody foresaw: the answer still ends, and says why
            log.exception("the answer to %r failed", question[:60])
            error = e
            stats["error"] = f"unexpected error: {e!r}"
        # (only the loop's own end, GeneratorExit, gets past the handlers above: nothing to reset then)
        try:
            self.ended.emit(self._keep(Ended(cid, mid, question, outcome, stats, error), live))
        finally:
            self.live = None
            self.task = None
            self.idle.emit(mid)

    async def _stream(self, cid: int, live: dict[str, Any], model: str | None, temperature: float) -> None:
        history = self.store.history(cid)  # (the empty answer being written is left out)
        stats = live["stats"]
        async for ch in self.client.chat(history, model=model, temperature=temperature):
            if ch.note:  # the cluster says why the answer waits (the gateway splicing in the rest)
                live["note"] = ch.note
                self.noted.emit(ch.note)
            if ch.text:
                live["pieces"] += 1
                if live["first"] is None or live["note"]:
                    live["first"] = live["first"] or time.perf_counter()
                    live["note"] = None
                    self.answering.emit()
                live["text"] += ch.text
                self.chunk.emit(ch.text)
            if ch.stats:
                stats["nodes"] = ch.stats.get("nodes") or []
                stats["tokens"] = ch.stats.get("completion_tokens")
            self.progressed.emit()

    def _keep(self, end: Ended, live: dict[str, Any]) -> Ended:
        """Keep what came in the store, with its figures and how it ended."""
        stats = end.stats
        now, first = time.perf_counter(), live["first"]
        if first is not None:
            stats["ttft_s"] = round(first - live["t0"], 3)
            tokens = stats.get("tokens") or live["pieces"]
            if now > first and tokens > 1:
                stats["tok_s"] = round((tokens - 1) / (now - first), 1)
        if end.outcome == "stopped":
            stats["stopped"] = True
        text, previous = live["text"], live["previous"]
        if end.outcome == "unreachable" and not text and previous is None:
            # nothing came back: the question goes back into the draft, to be sent again
            self.store.delete_message(end.message)
            msgs = self.store.messages(end.conversation)
            if msgs and msgs[-1].role == "user":
                self.store.delete_message(msgs[-1].id)
            self.store.set_draft(end.conversation, end.question)
            end.unsent = True
            return end
        if previous is not None and not text:  # a retry that brought nothing: the failed answer stays
            text, stats = previous if end.outcome in ("done", "stopped") else (previous[0], stats)
        self.store.update(end.message, text, stats)
        end.stats = stats
        return end
