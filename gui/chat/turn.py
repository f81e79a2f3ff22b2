"""What can be done with the last turn of the conversation a chat window shows: Retry an answer
that failed, Regenerate one (the new answer replaces the old, in the store too), Edit the
question (it goes back in the box, and Send replaces the turn) and Continue an answer the token
limit cut ("stopped: length": the model goes on with that very answer, and what comes joins it).

The buttons under the message box and the links under the last answer both lead here; the
answers themselves stream through the window's :class:`~gui.chat.answer.AnswerStream`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import QPushButton

from gui.chat.transcript import cut_short

if TYPE_CHECKING:
    from gui.chat.window import ChatWindow


class LastTurn:
    """The last-turn actions of one chat window, and the turn being edited (``editing``)."""

    def __init__(self, w: ChatWindow) -> None:
        self.w = w
        self.editing: tuple[int, int] | None = None  # (conversation, question id): Send replaces that turn
        self.buttons: dict[str, QPushButton] = {
            "retry": w.retry_btn,
            "continue": w.continue_btn,
            "regenerate": w.regenerate_btn,
            "edit": w.edit_btn,
        }
        self.actions = {"retry": self.retry, "continue": self.go_on, "regenerate": self.regenerate, "edit": self.edit}
        for name, btn in self.buttons.items():
            btn.clicked.connect(self.actions[name])

    def offers(self) -> set[str]:
        """What can be done with the shown conversation's last turn now: retry (its answer
        failed), continue (the token limit cut it), regenerate and edit (any whole turn)."""
        turn = self.w.answers.last_turn(self.w.conversation)
        if turn is None:
            return set()
        if self.can_retry():
            return {"retry", "edit"}
        return {"regenerate", "edit"} | ({"continue"} if cut_short(turn[1].stats) else set())

    def show(self, offer: set[str]) -> None:
        """Show the buttons of what is on ``offer``, and only those."""
        for name, btn in self.buttons.items():
            btn.setVisible(name in offer)

    def can_retry(self) -> bool:
        """Whether the shown conversation ends in a failed answer that Retry can ask again."""
        return self.w.answers.can_retry(self.w.conversation)

    def retry(self) -> None:
        """Ask the last question again; the new answer replaces the failed one."""
        if self.can_retry():
            self._again()

    def regenerate(self) -> None:
        """Ask the last question again: the new answer replaces the old one, in the store too."""
        if self.w.answers.last_turn(self.w.conversation) is not None:
            self._again()

    def _again(self) -> None:
        w = self.w
        assert w.conversation is not None
        self.editing = None
        w.answers.retry(w.conversation, w.model.currentText() or None, w.temperature.value())
        w.started()

    def edit(self) -> None:
        """Put the last question back in the box: Send replaces that turn (Esc leaves it be)."""
        w = self.w
        turn = w.answers.last_turn(w.conversation)
        if turn is None or w.conversation is None:
            return
        self.editing = (w.conversation, turn[0].id)
        w.input.setPlainText(turn[0].content)
        w.input.setFocus()
        w.input.moveCursor(QTextCursor.MoveOperation.End)
        w.status.setText("Editing your last message: Send replaces that turn, Esc cancels.")

    def go_on(self) -> None:
        """Continue the answer the token limit cut: the model goes on with it, and what comes
        joins the same answer."""
        w = self.w
        if not w.answers.can_continue(w.conversation):
            return
        assert w.conversation is not None
        self.editing = None
        w.answers.go_on(w.conversation, w.model.currentText() or None, w.temperature.value())
        w.started()

    def send(self, cid: int, text: str, model: str | None, temperature: float) -> None:
        """Send ``text`` in conversation ``cid``: it replaces the turn being edited, if that is
        still the conversation's last; otherwise it is a new turn."""
        editing, self.editing = self.editing, None
        turn = self.w.answers.last_turn(cid)
        if editing is not None and editing[0] == cid and turn is not None and turn[0].id == editing[1]:
            self.w.answers.resend(cid, editing[1], text, model, temperature)
        else:
            self.w.answers.ask(cid, text, model, temperature)

    def leave_edit(self) -> bool:
        """Esc with nothing streaming: leave an edit be (the box is emptied); whether there was one."""
        if self.editing is None:
            return False
        self.editing = None
        self.w.input.clear()
        self.w.status.setText("")
        return True
