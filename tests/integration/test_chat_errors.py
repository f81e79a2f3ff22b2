"""The chat never wedges (issue 37): an answer cut mid-stream, a refused connection and an
invalid coordinator URL each end in a visible state (the error said, the partial text kept),
Send and Stop work again, the next message is answered, and Retry asks again. Against a real
aiohttp server on 127.0.0.1 that speaks the coordinator's stream and breaks it on purpose;
offscreen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from coordinator.lab.local_cluster import free_port
from gui.chat.store import Store
from gui.chat.window import ChatWindow
from gui.client import Client, url_problem
from tests.support.fake_agent import FULL, NOTE, PARTIAL, FakeCoordinator
from tests.support.qt import run
from tests.support.wait import async_wait_until

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def fake(qloop: asyncio.AbstractEventLoop) -> Iterator[FakeCoordinator]:
    f = FakeCoordinator()
    run(qloop, f.start())
    yield f
    run(qloop, f.stop())


@pytest.fixture
def chat(qloop: asyncio.AbstractEventLoop, tmp_path: Path) -> Iterator[Callable[[Client], ChatWindow]]:
    made: list[ChatWindow] = []

    def make(client: Client) -> ChatWindow:
        w = ChatWindow(client, Store(tmp_path / f"c{len(made)}.sqlite3"))
        made.append(w)
        return w

    yield make
    for w in made:
        run(qloop, w.async_stop())
        w.close()
        w.store.close()
        run(qloop, w.client.close())


def ask(loop: asyncio.AbstractEventLoop, w: ChatWindow, text: str) -> None:
    """Type ``text``, press Send, and wait for the answer to end (however it ends)."""
    w.input.setPlainText(text)
    w.send_btn.click()
    assert w.streaming is not None and w.stop_btn.isEnabled() and not w.send_btn.isEnabled()
    run(loop, async_wait_until(lambda: w.streaming is None, what="the answer to end"))


def ready(w: ChatWindow) -> bool:
    """Idle and usable: Send works, Stop has nothing to stop."""
    return w.streaming is None and w.send_btn.isEnabled() and not w.stop_btn.isEnabled()


def reachable(loop: asyncio.AbstractEventLoop, w: ChatWindow) -> None:
    run(loop, async_wait_until(lambda: w.reachable and w.model.currentText() == "fake-model", what="the coordinator"))


@pytest.mark.parametrize(
    ("play", "why"),
    [
        ("cut", "Interrupted: the connection to the coordinator broke off."),
        ("eof", "Interrupted: the stream ended before the answer was complete."),
        ("garbled", "Interrupted: the stream carried something unreadable."),
        ("error", "Error: generation failed: a stage died"),
    ],
)
def test_an_answer_cut_mid_stream_keeps_its_text_says_so_and_the_next_message_is_answered(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, chat: Callable[[Client], ChatWindow], play: str, why: str
) -> None:
    w = chat(Client(fake.url))
    reachable(qloop, w)
    fake.plays = [play]
    ask(qloop, w, "What is the capital of France?")
    assert ready(w)
    first = w.conversation
    assert first is not None
    q, a = w.store.messages(first)
    assert (q.content, a.content) == ("What is the capital of France?", PARTIAL)
    assert why.split(": ", 1)[1].rstrip(".") in (a.stats.get("interrupted") or a.stats.get("error")), a.stats
    shown = w.transcript.toPlainText()
    assert PARTIAL.strip() in shown and why in shown and "Retry" in shown
    assert why.split(":")[0].lower() in w.status.text().lower() and w.retry_btn.isVisibleTo(w)

    # the next message, in this conversation, is answered in full
    ask(qloop, w, "And of Italy?")
    msgs = w.store.messages(first)
    assert [m.content for m in msgs] == ["What is the capital of France?", PARTIAL, "And of Italy?", FULL]
    assert not msgs[-1].stats.get("interrupted") and msgs[-1].stats["nodes"] == ["n1"]
    assert ready(w) and w.status.text() == "" and not w.retry_btn.isVisibleTo(w)
    # the partial answer went with the history (it is what the user saw)
    assert fake.asked[-1][1] == {"role": "assistant", "content": PARTIAL}

    # and in another conversation
    fake.plays = [play]
    other = w.new_conversation()
    ask(qloop, w, "Name a river.")
    assert w.conversation == other and why in w.transcript.toPlainText()
    ask(qloop, w, "Name a river, please.")
    assert w.store.messages(other)[-1].content == FULL and ready(w)


def test_retry_asks_the_same_question_again_and_replaces_the_interrupted_answer(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, chat: Callable[[Client], ChatWindow]
) -> None:
    client = Client(fake.url)
    w = chat(client)
    reachable(qloop, w)
    fake.plays = ["cut"]
    ask(qloop, w, "What is the capital of France?")
    assert w.retry_btn.isVisibleTo(w) and 'href="retry:"' in w.transcript.toHtml()
    # a retry that reaches nobody leaves the interrupted answer as it was, and can be retried
    client.point_at(f"http://127.0.0.1:{free_port()}")
    w.retry_btn.click()
    run(qloop, async_wait_until(lambda: w.streaming is None, what="the retry to fail"))
    answer = w.store.messages(w.conversation or 0)[-1]
    assert answer.content == PARTIAL and "did not answer" in answer.stats["error"] and ready(w)
    assert w.retry_btn.isVisibleTo(w) and w.input.toPlainText() == "" and not w.pending_send
    client.point_at(fake.url)
    w.retry_btn.click()
    assert w.streaming is not None and not w.retry_btn.isVisibleTo(w) and w.stop_btn.isEnabled()
    run(qloop, async_wait_until(lambda: w.streaming is None, what="the answer"))
    msgs = w.store.messages(w.conversation or 0)
    assert [(m.role, m.content) for m in msgs] == [("user", "What is the capital of France?"), ("assistant", FULL)]
    assert not msgs[1].stats.get("interrupted") and ready(w) and not w.retry_btn.isVisibleTo(w)
    assert fake.asked[0] == fake.asked[1] == [{"role": "user", "content": "What is the capital of France?"}]
    assert "Interrupted" not in w.transcript.toPlainText()


def test_a_status_note_and_a_silent_pause_do_not_end_the_answer(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, chat: Callable[[Client], ChatWindow]
) -> None:
    """The gateway keeps the stream open while the cluster finds a new coordinator: its note
    shows, comment lines are skipped, unknown fields ignored, and the answer goes on."""
    w = chat(Client(fake.url))
    reachable(qloop, w)
    fake.plays = ["pause"]
    w.input.setPlainText("What is the capital of France?")
    w.send()
    run(qloop, async_wait_until(lambda: w.status.text() == NOTE, what="the note"))
    assert NOTE in w.transcript.toPlainText() and w.stop_btn.isEnabled() and w.live is not None
    assert w.live["text"] == PARTIAL
    fake.go_on.set()
    run(qloop, async_wait_until(lambda: w.streaming is None, what="the answer"))
    answer = w.store.messages(w.conversation or 0)[-1]
    assert answer.content == FULL and not answer.stats.get("interrupted") and ready(w)
    assert NOTE not in w.transcript.toPlainText()


def test_a_refused_connection_puts_the_question_back_and_it_goes_out_once_one_answers(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, chat: Callable[[Client], ChatWindow]
) -> None:
    client = Client(fake.url)
    w = chat(client)
    reachable(qloop, w)
    client.point_at(f"http://127.0.0.1:{free_port()}")  # the coordinator went away since
    ask(qloop, w, "Say hello.")
    assert ready(w) and w.input.toPlainText() == "Say hello." and w.pending_send
    assert w.store.messages(w.conversation or 0) == []
    assert w.banner.isVisibleTo(w) and "No coordinator is reachable" in w.banner.text()
    assert "will be sent" in w.banner.text() and "Connect call failed" in w.banner.text()
    client.point_at(fake.url)
    run(
        qloop,
        async_wait_until(lambda: w.store.messages(w.conversation or 0), what="the message to go out and be answered"),
    )
    run(qloop, async_wait_until(lambda: w.streaming is None, what="the answer"))
    assert [m.content for m in w.store.messages(w.conversation or 0)] == ["Say hello.", FULL]
    assert ready(w) and not w.banner.isVisibleTo(w) and w.input.toPlainText() == ""


@pytest.mark.parametrize("bad", ["localhost:8000", "http://10.0.0.5:99999", "http://", "http://[::1"])
def test_an_invalid_coordinator_url_says_so_and_nothing_wedges(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, chat: Callable[[Client], ChatWindow], bad: str
) -> None:
    # a bad URL already in tray.json when the tray starts
    client = Client(fake.url, coordinator_url=bad)
    w = chat(client)
    run(qloop, async_wait_until(lambda: w.reachable is False and w.banner.isVisibleTo(w), what="the banner"))
    assert f"The coordinator URL {bad!r} in Settings is not valid" in w.banner.text()
    assert "Correct it in Settings" in w.banner.text()
    w.input.setPlainText("Say hello.")
    w.send_btn.click()
    assert ready(w) and w.pending_send and w.input.toPlainText() == "Say hello."
    client.point_at(fake.url)  # corrected in Settings
    run(
        qloop,
        async_wait_until(
            lambda: len(w.store.messages(w.conversation or 0)) == 2 and w.streaming is None, what="the answer"
        ),
    )
    assert w.store.messages(w.conversation or 0)[-1].content == FULL and not w.banner.isVisibleTo(w)

    # a bad URL set while the window thinks the coordinator is there: the answer ends at once
    client.point_at(bad)
    ask(qloop, w, "Say it again.")
    assert ready(w) and w.input.toPlainText() == "Say it again." and "not valid" in w.banner.text()
    client.point_at(fake.url)
    run(
        qloop,
        async_wait_until(
            lambda: len(w.store.messages(w.conversation or 0)) == 4 and w.streaming is None, what="the answer"
        ),
    )
    assert w.store.messages(w.conversation or 0)[-1].content == FULL and ready(w)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("", None),
        ("http://10.0.0.5:8000", None),
        ("https://coordinator.office.lan/v1", None),
        ("http://[fe80::1]:8000/", None),
        ("localhost:8000", "must start with http:// or https://"),
        ("ftp://10.0.0.5", "must start with http:// or https://"),
        ("http://", "names no host"),
        ("http://10.0.0.5:99999", "Port out of range"),
        ("http://10.0.0.5:0", "port 0"),
        ("http://10.0.0.5:80a", "not a valid URL"),
        ("http://[::1", "not a valid URL"),
        ("http://my host:8000", "spaces"),
        ("http://10.0.0.5:8000/?x=1", "?query"),
    ],
)
def test_coordinator_urls_are_checked(url: str, problem: str | None) -> None:
    got = url_problem(url)
    assert got == problem if problem is None else (got is not None and problem in got), got


def test_settings_refuse_an_invalid_coordinator_url_and_save_nothing(
    qloop: asyncio.AbstractEventLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gui.settings import SettingsDialog, tray_settings_file

    monkeypatch.setenv("LAKESHARD_HOME", str(tmp_path / "home"))
    client = Client(f"http://127.0.0.1:{free_port()}")  # no agent either: the URL is checked first
    d = SettingsDialog(client)
    d.coordinator_url.setText("localhost:8000")
    assert not d.url_error.isHidden() and not d.save_btn.isEnabled()
    assert "must start with http:// or https://" in d.url_error.text()
    assert "must start with http:// or https://" in d.message.text()  # seen from every tab
    assert run(qloop, d.async_save()) is False
    assert d.message.text().startswith("not saved: The coordinator URL is not valid")
    assert not tray_settings_file().exists() and client.coordinator_url == client.agent_url
    d.coordinator_url.setText("http://10.0.0.5:8000")
    assert d.url_error.isHidden() and d.save_btn.isEnabled() and d.message.text() == ""
    d.coordinator_url.setText("")  # blank: through the local agent
    assert d.url_error.isHidden() and d.save_btn.isEnabled()
    run(qloop, client.close())


def test_the_agents_no_coordinator_answer_is_said_once_in_the_banner(
    qloop: asyncio.AbstractEventLoop, chat: Callable[[Client], ChatWindow]
) -> None:
    """While the coordinator restarts (a new model, an election), this laptop's agent answers 503
    no_coordinator: the banner says so in one sentence, not the same words twice."""
    said = "no coordinator is reachable right now (an election may be under way); retry"

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": said, "code": "no_coordinator"}}, status=503)

    async def start() -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    runner = run(qloop, start())
    try:
        w = chat(Client(f"http://127.0.0.1:{runner.addresses[0][1]}"))
        run(qloop, async_wait_until(lambda: w.reachable is False and w.banner.isVisibleTo(w), what="the banner"))
        text = w.banner.text()
        assert text == "No coordinator is reachable right now (an election may be under way); retrying every 2 s."
        assert text.lower().count("no coordinator is reachable") == 1
    finally:
        run(qloop, runner.cleanup())


def test_a_long_conversation_opens_at_its_end_and_a_new_question_is_followed(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, chat: Callable[[Client], ChatWindow]
) -> None:
    """Reopened (or reopening the chat window), a conversation longer than the window shows its
    latest answer, and a question sent while scrolled up brings the reader to the answer."""
    w = chat(Client(fake.url))
    w.resize(700, 420)
    w.show()
    reachable(qloop, w)
    for i in range(8):
        ask(qloop, w, f"Question {i}: say it again.")
    first = w.conversation
    assert first is not None
    bar = w.transcript.verticalScrollBar()
    w.new_conversation()
    assert w.conversation != first
    w.open_conversation(first)
    assert bar.maximum() > 0 and bar.value() == bar.maximum()
    bar.setValue(0)  # the reader scrolls up, then asks
    w.input.setPlainText("One more.")
    w.send_btn.click()
    assert bar.value() == bar.maximum()
    run(qloop, async_wait_until(lambda: w.streaming is None, what="the answer to end"))
    assert bar.value() == bar.maximum()


def test_the_chat_window_opened_from_the_tray_shows_the_end_of_a_long_conversation(
    qloop: asyncio.AbstractEventLoop, fake: FakeCoordinator, tmp_path: Path
) -> None:
    """The tray makes the window when Open chat is chosen: the last conversation opens hidden,
    then shows; the reader sees its latest answer, and the next answer is followed."""
    store = Store(tmp_path / "long.sqlite3")
    cid = store.create("a long one")
    for i in range(8):
        store.add(cid, "user", f"Question {i}: say it again.")
        store.add(cid, "assistant", FULL)
    w = ChatWindow(Client(fake.url), store)
    try:
        w.resize(700, 420)
        w.show()
        reachable(qloop, w)
        bar = w.transcript.verticalScrollBar()
        assert w.conversation == cid and bar.maximum() > 0 and bar.value() == bar.maximum()
        ask(qloop, w, "One more.")
        assert bar.value() == bar.maximum()
    finally:
        run(qloop, w.async_stop())
        run(qloop, w.client.close())
        w.deleteLater()
        store.close()
