"""The chat as people use it every day (issue 40): Regenerate and Edit-and-resend on the last turn,
Continue after the token limit, search across conversations, export as Markdown, highlighted
code, a dark mode that follows the palette, the shortcuts, "served by" with the names recorded
at answer time and every laptop of a failover, and no stale status after New conversation.
Each drives the window's widgets against a real aiohttp server on 127.0.0.1 that speaks the
coordinator's OpenAI stream (:class:`tests.support.fake_agent.FakeCoordinator`); offscreen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette, QTextCursor
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QFileDialog

from agent.protocol.cluster_view import ClusterView, NodeInfo
from agent.protocol.events import Event, NodeJoined, NodeLeft, PlanChanged, Snapshot, apply_event
from gui.chat.export import conversation_markdown
from gui.chat.store import Store
from gui.chat.theme import MIN_CONTRAST, contrast
from gui.chat.window import ChatWindow
from gui.client import Client
from tests.support.fake_agent import FULL, NOTE, FakeCoordinator
from tests.support.qt import run
from tests.support.wait import async_wait_until

pytestmark = pytest.mark.timeout(120)

CODE_ANSWER = "Like this:\n\n```python\ndef hello(name):\n    return f'hi {name}'  # greet\n```\n\nDone."
DARK = {
    QPalette.ColorRole.Window: "#2b2b2b",
    QPalette.ColorRole.WindowText: "#e8e8e8",
    QPalette.ColorRole.Base: "#1e1e1e",
    QPalette.ColorRole.AlternateBase: "#262626",
    QPalette.ColorRole.Text: "#e8e8e8",
    QPalette.ColorRole.Button: "#353535",
    QPalette.ColorRole.ButtonText: "#e8e8e8",
    QPalette.ColorRole.Link: "#5aa9ff",
    QPalette.ColorRole.Highlight: "#2f65ca",
    QPalette.ColorRole.HighlightedText: "#ffffff",
    QPalette.ColorRole.PlaceholderText: "#8c8c8c",
}


def pieces(text: str, n: int = 7) -> list[str]:
    """``text`` as the pieces of a stream."""
    return [text[i : i + n] for i in range(0, len(text), n)]


@pytest.fixture
def fake(qloop: asyncio.AbstractEventLoop) -> Iterator[FakeCoordinator]:
    f = FakeCoordinator()
    run(qloop, f.start())
    yield f
    f.go_on.set()  # (an answer left paused would hold the server's shutdown)
    run(qloop, f.stop())


@pytest.fixture
def chat(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, tmp_path: Path
) -> Iterator[Callable[..., ChatWindow]]:
    """Make a chat window on the fake coordinator (on the store at ``db``, a new one by default),
    and wait until it has the model list."""
    made: list[ChatWindow] = []

    def make(db: Path | None = None, names: dict[str, str] | None = None) -> ChatWindow:
        w = ChatWindow(Client(fake.url), Store(db or tmp_path / f"c{len(made)}.sqlite3"), names=names)
        made.append(w)
        run(qloop, async_wait_until(lambda: w.reachable and w.model.currentText() == "fake-model", what="models"))
        return w

    yield make
    for w in made:
        run(qloop, w.async_stop())
        w.close()
        w.store.close()
        w.deleteLater()
        run(qloop, w.client.close())


def ended(loop: asyncio.AbstractEventLoop, w: ChatWindow) -> None:
    run(loop, async_wait_until(lambda: w.streaming is None, what="the answer to end"))


def ask(loop: asyncio.AbstractEventLoop, w: ChatWindow, text: str) -> None:
    """Type ``text``, press Send, and wait for the answer to end."""
    w.input.setPlainText(text)
    w.send_btn.click()
    assert w.streaming is not None
    ended(loop, w)


def contents(w: ChatWindow) -> list[str]:
    return [m.content for m in w.store.messages(w.conversation or 0)]


def keys(w: ChatWindow, key: Qt.Key, mods: Qt.KeyboardModifier = Qt.KeyboardModifier.NoModifier) -> None:
    """Press ``key`` in the focused widget of the (shown, active) window, as a user does."""
    w.show()
    w.activateWindow()
    assert QTest.qWaitForWindowActive(w)
    QTest.keyClick(QApplication.focusWidget() or w, key, mods)


def test_regenerate_produces_a_new_answer_that_replaces_the_old_one_in_storage(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, chat: Callable[..., ChatWindow]
) -> None:
    w = chat()
    fake.replies = [(["A first ", "answer."], "stop"), (["A better ", "answer."], "stop")]
    ask(qloop, w, "Explain shards.")
    old = w.store.messages(w.conversation or 0)[1]
    assert old.content == "A first answer." and w.regenerate_btn.isVisibleTo(w) and not w.retry_btn.isVisibleTo(w)
    assert 'href="regenerate:"' in w.transcript.toHtml()
    w.regenerate_btn.click()
    assert w.streaming is not None and not w.regenerate_btn.isVisibleTo(w)
    ended(qloop, w)
    q, a = w.store.messages(w.conversation or 0)
    assert (q.content, a.id, a.content) == ("Explain shards.", old.id, "A better answer.")
    assert fake.asked[-1] == [{"role": "user", "content": "Explain shards."}]  # (the old answer went nowhere)
    assert "A first" not in w.transcript.toPlainText() and "A better answer." in w.transcript.toPlainText()


def test_edit_puts_the_last_question_back_and_resending_replaces_that_turn(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, chat: Callable[..., ChatWindow]
) -> None:
    w = chat()
    ask(qloop, w, "Waht is a shard?")  # the conversation is named after it
    w.edit_btn.click()
    assert w.input.toPlainText() == "Waht is a shard?" and "Send replaces" in w.status.text()
    w.input.setPlainText("What is a shard?")
    w.send_btn.click()
    ended(qloop, w)
    assert contents(w) == ["What is a shard?", FULL]
    assert w.store.get(w.conversation or 0).title == "What is a shard?"  # type: ignore[union-attr]
    assert fake.asked[-1] == [{"role": "user", "content": "What is a shard?"}]
    # on a later turn, only that turn is replaced
    ask(qloop, w, "And a pipelin?")
    w.edit_btn.click()
    w.input.setPlainText("And a pipeline?")
    w.send_btn.click()
    ended(qloop, w)
    assert contents(w) == ["What is a shard?", FULL, "And a pipeline?", FULL]
    assert w.store.get(w.conversation or 0).title == "What is a shard?"  # type: ignore[union-attr]
    assert fake.asked[-1][-1] == {"role": "user", "content": "And a pipeline?"} and len(fake.asked[-1]) == 3
    # Esc leaves an edit be: the next message is a new turn
    w.edit_btn.click()
    keys(w, Qt.Key.Key_Escape)
    assert w.turn.editing is None and w.input.toPlainText() == ""
    ask(qloop, w, "Thanks.")
    assert contents(w)[-2:] == ["Thanks.", FULL] and len(contents(w)) == 6


def test_an_answer_cut_at_the_token_limit_says_so_and_continue_appends_to_it(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, chat: Callable[..., ChatWindow]
) -> None:
    w = chat()
    fake.replies = [(["The capital ", "of France "], "length"), (["is ", "Paris."], "stop")]
    ask(qloop, w, "What is the capital of France?")
    answer = w.store.messages(w.conversation or 0)[1]
    assert answer.content == "The capital of France " and answer.stats["finish"] == "length"
    assert "stopped: length" in w.status.text() and "stopped: length" in w.transcript.toPlainText()
    assert w.continue_btn.isVisibleTo(w) and 'href="continue:"' in w.transcript.toHtml()
    w.continue_btn.click()
    ended(qloop, w)
    a = w.store.messages(w.conversation or 0)[1]
    assert (a.id, a.content) == (answer.id, "The capital of France is Paris.")
    assert a.stats["finish"] == "stop" and a.stats["tokens"] == 4 and a.stats["ttft_s"] == answer.stats["ttft_s"]
    # the partial answer went as the final assistant message, to be continued (not a new turn)
    assert fake.bodies[-1]["continue_final_message"] is True
    assert fake.asked[-1] == [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France "},
    ]
    assert "continue_final_message" not in fake.bodies[0]  # (the first answer was asked as usual)
    assert not w.continue_btn.isVisibleTo(w) and "stopped: length" not in w.transcript.toPlainText()
    assert "The capital of France is Paris." in w.transcript.toPlainText() and w.status.text() == ""


def test_search_finds_a_word_in_an_old_conversation_and_opens_it(
    qloop: asyncio.AbstractEventLoop, tmp_path: Path, chat: Callable[..., ChatWindow]
) -> None:
    db = tmp_path / "old.sqlite3"
    s = Store(db)
    old = s.create()
    s.add(old, "user", "Where is the ferry to Zanzibar?")
    s.add(old, "assistant", "It leaves from Dar es Salaam.")
    for i in range(3):  # newer conversations on top
        s.add(s.create(), "user", f"Question {i}")
    s.close()
    w = chat(db)
    assert w.conversation != old
    keys(w, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    assert QApplication.focusWidget() is w.search
    QTest.keyClicks(w.search, "zanzibar")
    shown = [w.list.item(i) for i in range(w.list.count()) if not w.list.item(i).isHidden()]
    assert [it.data(Qt.ItemDataRole.UserRole) for it in shown] == [old] and "Zanzibar" in shown[0].toolTip()
    QTest.keyClick(w.search, Qt.Key.Key_Return)
    assert w.conversation == old and "ferry to Zanzibar" in w.transcript.toPlainText()
    assert w.transcript.textCursor().selectedText().lower() == "zanzibar"
    assert w.store.search("%") == [] and w.store.search("_") == []  # (LIKE's wildcards are words here)
    w.search.clear()
    assert all(not w.list.item(i).isHidden() for i in range(w.list.count())) and w.list.count() == 4


def test_a_conversation_exports_as_markdown(
    qloop: asyncio.AbstractEventLoop,
    fake: FakeCoordinator,
    chat: Callable[..., ChatWindow],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = chat(names={"n1": "ann-laptop"})
    w.system.setPlainText("Be brief.")
    fake.replies = [(pieces(CODE_ANSWER), "stop")]
    ask(qloop, w, "How do I greet?")
    cid = w.conversation or 0
    md = conversation_markdown(w.store, cid, w.names)  # the function, without a dialog
    assert md.startswith("# How do I greet?\n") and "> Be brief." in md
    assert "## You\n\nHow do I greet?\n" in md and f"## Assistant\n\n{CODE_ANSWER}\n" in md
    assert "```python\ndef" in md and "served by ann-laptop" in md
    # and through the window: the dialog's answer is where it goes
    target = tmp_path / "out" / "greet.md"
    target.parent.mkdir()
    asked: list[str] = []

    def save_as(*a: object, **k: object) -> tuple[str, str]:
        asked.append(str(a[2]))
        return str(target), "Markdown (*.md)"

    monkeypatch.setattr(QFileDialog, "getSaveFileName", save_as)
    w.export_btn.click()
    assert asked[0].endswith("How-do-I-greet.md") and target.read_text(encoding="utf-8") == md
    assert "greet.md" in w.status.text()


def fragments(w: ChatWindow) -> list[tuple[str, str, str]]:
    """Every piece of text in the transcript with the colours Qt draws it in: (text, fg, bg)."""
    doc = w.transcript.document()
    pal = w.transcript.palette()
    fg0, bg0 = pal.color(QPalette.ColorRole.Text).name(), pal.color(QPalette.ColorRole.Base).name()
    out = []
    block = doc.begin()
    while block.isValid():
        cur = QTextCursor(block)
        bg = bg0
        table = cur.currentTable()
        if table is not None:
            for brush in (table.format().background(), table.cellAt(cur).format().background()):
                if brush.style() != Qt.BrushStyle.NoBrush:
                    bg = brush.color().name()
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            if frag.isValid() and frag.text().strip():
                f = frag.charFormat().foreground()
                out.append((frag.text(), f.color().name() if f.style() != Qt.BrushStyle.NoBrush else fg0, bg))
            it += 1
        block = block.next()
    return out


def test_dark_mode_follows_the_palette_and_body_text_is_readable_in_both(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, chat: Callable[..., ChatWindow]
) -> None:
    w = chat(names={"n1": "ann-laptop"})
    fake.replies = [(pieces(CODE_ANSWER), "length")]
    ask(qloop, w, "How do I greet?")
    light = QApplication.palette()
    dark = QPalette(light)
    for role, colour in DARK.items():
        dark.setColor(role, QColor(colour))
    seen = {}
    try:
        for name, palette in (("light", light), ("dark", dark)):
            QApplication.setPalette(palette)
            QApplication.processEvents()
            assert w.theme.dark is (name == "dark") and w.theme.base == palette.color(QPalette.ColorRole.Base).name()
            drawn = fragments(w)
            texts = " ".join(t for t, _, _ in drawn)
            assert "How do I greet?" in texts and "hello" in texts and "served by ann-laptop" in texts
            low = [(t, fg, bg, round(contrast(fg, bg), 2)) for t, fg, bg in drawn if contrast(fg, bg) < MIN_CONTRAST]
            assert low == [], f"{name}: text below {MIN_CONTRAST}:1"
            status = QColor(w.status.styleSheet().split("color:")[1]).name()
            assert contrast(status, w.status.palette().color(QPalette.ColorRole.Window).name()) >= MIN_CONTRAST
            seen[name] = {bg for _, _, bg in drawn}
    finally:
        QApplication.setPalette(light)
    assert not seen["light"] & seen["dark"]  # no background stays from the other palette


def test_code_blocks_are_highlighted_with_pygments(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, chat: Callable[..., ChatWindow]
) -> None:
    w = chat()
    fake.replies = [(pieces(CODE_ANSWER), "stop"), (["```\nplain", " text\n```"], "stop")]
    ask(qloop, w, "How do I greet?")
    drawn = fragments(w)

    def colour(word: str) -> str:
        return next(fg for t, fg, _ in drawn if word in t)

    keyword, string, comment = colour("def"), colour("hi "), colour("# greet")
    assert len({w.theme.text, keyword, string, comment}) == 4, drawn
    assert colour("Like this") == colour("Done.") == w.theme.text  # (prose is not code)
    ask(qloop, w, "And without a language?")
    drawn = fragments(w)
    assert colour("plain text") == w.theme.text
    assert w.blocks[-1] == "plain text"


def test_shortcuts_stop_start_search_and_copy_the_last_code_block(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, chat: Callable[..., ChatWindow]
) -> None:
    w = chat()
    fake.replies = [(pieces(CODE_ANSWER), "stop")]
    w.input.setPlainText("How do I greet?")
    w.input.setFocus()
    keys(w, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)  # Ctrl+Enter sends
    assert w.streaming is not None
    ended(qloop, w)
    keys(w, Qt.Key.Key_C, Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier)
    assert QGuiApplication.clipboard().text() == "def hello(name):\n    return f'hi {name}'  # greet"
    assert w.status.text() == "code copied"
    fake.plays = ["pause"]
    w.input.setPlainText("And again?")
    w.send_btn.click()
    run(qloop, async_wait_until(lambda: w.status.text() == NOTE, what="the answer to wait"))
    keys(w, Qt.Key.Key_Escape)  # Esc stops
    ended(qloop, w)
    assert w.store.messages(w.conversation or 0)[-1].stats.get("stopped") is True
    first = w.conversation
    keys(w, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)  # Ctrl+N: a new conversation
    assert w.conversation != first and contents(w) == [] and w.list.count() == 2
    keys(w, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    assert QApplication.focusWidget() is w.search


def test_no_stale_stopped_status_after_new_conversation(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, chat: Callable[..., ChatWindow]
) -> None:
    w = chat()
    fake.plays = ["pause"]
    w.input.setPlainText("Tell me a long story.")
    w.send_btn.click()
    run(qloop, async_wait_until(lambda: w.status.text() == NOTE, what="the answer to wait"))
    w.stop_btn.click()
    ended(qloop, w)
    assert w.status.text() == "stopped"
    w.new_btn.click()
    assert w.status.text() == "" and w.conversation is not None and contents(w) == []


def cluster(w: ChatWindow, view: ClusterView | None, *events: Event) -> ClusterView | None:
    """Feed ``events`` to the window as the tray passes on its event stream; the view after them."""
    for ev in events:
        view = apply_event(view, ev)
        w.on_cluster_event((ev, view))
    return view


def test_served_by_keeps_the_names_of_answer_time_and_every_laptop_of_a_failover(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, chat: Callable[..., ChatWindow], tmp_path: Path
) -> None:
    ann, bob, carol = (
        NodeInfo(i, f"{n}-laptop", f"10.0.0.{k}:7700", "follower", "available")
        for k, (i, n) in enumerate([("aaa", "ann"), ("bbb", "bob"), ("ccc", "carol")])
    )
    w = chat(tmp_path / "served.sqlite3")
    start = ClusterView("office", "aaa", 1, "m", "serving", ring=("aaa", "bbb"), nodes=(ann, bob))
    view = cluster(w, None, Snapshot(1.0, start))
    fake.plays, fake.nodes = ["pause"], ["aaa", "ccc"]  # the API names only the plan at the end
    w.input.setPlainText("Write a poem.")
    w.send_btn.click()
    run(qloop, async_wait_until(lambda: w.status.text() == NOTE, what="the answer to be under way"))
    # bob dies mid-answer: a re-plan (whose ring computes nothing yet), then carol goes on with it
    view = cluster(
        w,
        view,
        NodeLeft(2.0, "bbb", "bob-laptop"),
        PlanChanged(2.1, ("aaa",), ((0, 30),), "m", "re-planning", 2),
        NodeJoined(2.2, carol),
        PlanChanged(2.3, ("aaa", "ccc"), ((0, 15), (15, 30)), "m", "serving", 2),
    )
    fake.go_on.set()
    ended(qloop, w)
    a = w.store.messages(w.conversation or 0)[-1]
    assert a.content == FULL and a.stats["plans"] == [["aaa", "bbb"], ["aaa", "ccc"]]
    assert a.stats["nodes"] == ["aaa", "bbb", "ccc"]
    assert a.stats["names"] == {"aaa": "ann-laptop", "bbb": "bob-laptop", "ccc": "carol-laptop"}
    said = "served by ann-laptop → bob-laptop, then ann-laptop → carol-laptop"
    assert said in w.transcript.toPlainText()
    # later (after a restart, the cluster not heard from yet, those laptops gone): the same names
    cid = w.conversation
    later = chat(tmp_path / "served.sqlite3")
    later.open_conversation(cid or 0)
    assert said in later.transcript.toPlainText() and "bbb" not in later.transcript.toPlainText()
