"""The answer being streamed: one at a time, into the conversation store, told through Qt signals.

:class:`AnswerStream` asks the cluster (through the coordinator's OpenAI API), appends what
streams in to the answer it is writing and keeps it in the store however it ends: done,
stopped (Stop cancels the request, which cancels the generation on the cluster), interrupted
(its text stays, marked with the reason, for Retry to ask again) or failed. An answer that
could not be sent at all (no coordinator answered, nothing came back) is taken out of the
store again, its question kept as the conversation's draft. The view (:mod:`gui.chat.window`)
follows it through the signals and reads ``live`` to draw the answer being written.

Besides asking, it regenerates the last answer (:meth:`AnswerStream.retry`: the new one
replaces it), resends an edited last question (:meth:`AnswerStream.resend`: the turn is
replaced) and goes on with an answer cut at the token limit (:meth:`AnswerStream.go_on`: the
partial answer goes as the final assistant message with ``continue_final_message``, so that the
model continues that very answer, and what comes joins it). Each answer keeps how it ended
(``finish``) and who computed it: every plan (nodes in stage order) it ran on, from the cluster
as the event stream told it while it streamed (:meth:`AnswerStream.saw_plan`) and the nodes the
API named at its end, with their names as known then, so that it says the same later, when
those laptops are gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QObject, Signal

from gui.chat.store import NEW_TITLE, Message, Store
from gui.chat.transcript import cut_short, failed
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

    def __init__(
        self,
        client: Client,
        store: Store,
        names: dict[str, str] | None = None,
        ring: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        """``names``: node id -> name, as the cluster is known now (kept current by the view);
        ``ring``: the plan serving now (node ids in stage order; empty when not known)."""
        super().__init__()
        self.client, self.store = client, store
        self.names = names if names is not None else {}
        self.ring = ring or (lambda: ())
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
        turn = self.last_turn(cid)
        return turn is not None and failed(turn[1].stats)

    def last_turn(self, cid: int | None) -> tuple[Message, Message] | None:
        """The last question and its answer, when the conversation ends in a whole turn and
        nothing streams (what Regenerate, Edit and Continue work on)."""
        if cid is None or self.task is not None:
            return None
        msgs = self.store.messages(cid)[-2:]
        if [m.role for m in msgs] != ["user", "assistant"]:
            return None
        return msgs[0], msgs[1]

    def can_continue(self, cid: int | None) -> bool:
        """Whether conversation ``cid`` ends in an answer cut at the token limit."""
        turn = self.last_turn(cid)
        return turn is not None and cut_short(turn[1].stats)

    def retry(self, cid: int, model: str | None, temperature: float) -> None:
        """Ask the last question again; the new answer replaces the old one (failed, or not: this
        is Regenerate too) in the store (if the new try brings no text, the old one stays)."""
        question, answer = self.store.messages(cid)[-2:]
        self.store.update(answer.id, "", {})  # (so that it is not part of the question's history)
        self._start(cid, answer.id, question.content, (answer.content, answer.stats), model, temperature)

    def resend(self, cid: int, question: int, text: str, model: str | None, temperature: float) -> None:
        """Replace the last turn (question id ``question`` and its answer) with ``text`` and the
        answer to come. A conversation named after that question is named after ``text``."""
        msgs = self.store.messages(cid)
        turn = [m for m in msgs if m.id >= question]
        conv = self.store.get(cid)
        for m in turn:
            self.store.delete_message(m.id)
        first = bool(turn) and msgs[0].id == question
        if first and conv is not None and conv.title == " ".join(turn[0].content[:60].split()):
            self.store.rename(cid, NEW_TITLE)  # (``add`` names it after the new question)
        self.ask(cid, text, model, temperature)

    def go_on(self, cid: int, model: str | None, temperature: float) -> None:
        """Continue the answer that ends conversation ``cid`` (cut at the token limit): what
        comes is appended to it, in the store as on screen."""
        question, answer = self.store.messages(cid)[-2:]
        self._start(cid, answer.id, question.content, None, model, temperature, base=(answer.content, answer.stats))

    def saw_plan(self, ring: Sequence[str]) -> None:
        """The cluster serves on ``ring`` now (from its event stream): the answer being streamed,
        if any, ran on it too (after a failover, the nodes that went on with it)."""
        live = self.live
        if live is None or not ring:
            return
        if not live["plans"] or live["plans"][-1] != list(ring):
            live["plans"].append(list(ring))
        live["names"].update({n: self.names[n] for n in ring if n in self.names})

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
        base: tuple[str, dict[str, Any]] | None = None,
    ) -> None:
        """Stream an answer into message ``mid``: a new one, one that replaces ``previous`` (its
        text and figures, kept if the new try brings nothing), or one that goes on after ``base``."""
        text = base[0] if base is not None else ""
        self.live = {"id": mid, "text": text, "stats": {}, "conversation": cid, "question": question, "note": None}
        self.live.update(t0=time.perf_counter(), first=None, pieces=0, previous=previous, base=base)
        self.live.update(plans=[], names={})
        self.saw_plan(self.ring())
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
        extra: dict[str, Any] = {}
        if live["base"] is not None:  # the partial answer is the final message, left open: it goes on
            if not history or history[-1]["role"] != "assistant":
                history.append({"role": "assistant", "content": live["base"][0]})
            extra["continue_final_message"] = True
        stats = live["stats"]
        async for ch in self.client.chat(history, model=model, temperature=temperature, **extra):
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
            if ch.finish:
                stats["finish"] = ch.finish
            if ch.stats:
                self.saw_plan([str(n) for n in ch.stats.get("nodes") or []])
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
        if live["plans"]:
            stats["plans"] = live["plans"]
            stats["nodes"] = list(dict.fromkeys(n for plan in live["plans"] for n in plan))
            stats["names"] = {**live["names"], **{n: self.names[n] for n in stats["nodes"] if n in self.names}}
        text, previous, base = live["text"], live["previous"], live["base"]
        if base is not None:  # a continuation: what came joins the answer; if nothing did, it stays
            text, stats = (base[0], base[1]) if text == base[0] else (text, joined(base[1], stats))
            self.store.update(end.message, text, stats)
            end.stats = stats
            return end
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


def joined(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The figures of an answer and its continuation, as one answer's: how it ended and its rate
    are the continuation's; the time to its first token the first part's; its tokens, the nodes
    that computed it and their names, both parts'."""
    out = {**{k: v for k, v in before.items() if k not in ("finish", "stopped", "tok_s")}, **after}
    if before.get("ttft_s") is not None:
        out["ttft_s"] = before["ttft_s"]
    if before.get("tokens") is not None or after.get("tokens") is not None:
        out["tokens"] = (before.get("tokens") or 0) + (after.get("tokens") or 0)
    plans = list(before.get("plans") or ([before["nodes"]] if before.get("nodes") else []))
    for p in after.get("plans") or []:
        if not plans or plans[-1] != p:
            plans.append(p)
    if plans:
        out["plans"] = plans
        out["nodes"] = list(dict.fromkeys(n for p in plans for n in p))
    out["names"] = {**(before.get("names") or {}), **(after.get("names") or {})}
    if not out["names"]:
        del out["names"]
    return out
