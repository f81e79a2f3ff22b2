"""Search across conversations in the chat window (Ctrl+F): the list shows only the conversations
that say the words typed (each with the words around its first match as its tooltip), Enter
opens the first of them, and a conversation opened while searching shows the words selected.
The matching itself is the store's (:meth:`gui.chat.store.Store.search`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from PySide6.QtCore import Qt
from PySide6.QtGui import QTextCursor

if TYPE_CHECKING:
    from gui.chat.window import ChatWindow


class ConversationSearch:
    """The search box of one chat window, over its list of conversations."""

    def __init__(self, w: ChatWindow) -> None:
        self.w = w
        w.search.textChanged.connect(self.filter)
        w.search.returnPressed.connect(self.open_first)

    def focus(self) -> None:
        """Ctrl+F: into the search box, its words selected."""
        self.w.search.setFocus()
        self.w.search.selectAll()

    def filter(self, words: str) -> None:
        """Show only the conversations that say ``words`` (all, when empty), each with the words
        around its first match as its tooltip."""
        hits = dict(self.w.store.search(words)) if words.strip() else None
        lst = self.w.list
        for i in range(lst.count()):
            it = lst.item(i)
            cid = int(it.data(Qt.ItemDataRole.UserRole))
            it.setHidden(hits is not None and cid not in hits)
            it.setToolTip(hits.get(cid, "") if hits is not None else "")

    def refilter(self) -> None:
        """The list was filled again: filter it by the words in the box."""
        self.filter(self.w.search.text())

    def open_first(self) -> None:
        """Enter in the search box: open the first conversation found, at the words."""
        lst = self.w.list
        for i in range(lst.count()):
            it = lst.item(i)
            if not it.isHidden():
                lst.setCurrentItem(it)
                self.w.open_conversation(int(it.data(Qt.ItemDataRole.UserRole)))
                self.show_words()
                return

    def show_words(self) -> None:
        """Select the searched words in the open conversation, and scroll to them."""
        words = self.w.search.text().strip()
        if words:
            self.w.transcript.moveCursor(QTextCursor.MoveOperation.Start)
            self.w.transcript.find(words)

    def clear_typed(self) -> bool:
        """Esc in the search box: clear the words typed; whether there were any."""
        box = self.w.search
        if not (box.hasFocus() and box.text()):
            return False
        box.clear()
        return True
