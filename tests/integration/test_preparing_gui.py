"""Preparation you can see, in the GUI (issue 37): while the coordinator prepares its model, the
chat's banner says the step it is at and follows it live from the cluster event stream; once
ready, the banner goes, the model list fills and a message typed meanwhile is answered. The node
map writes each node's step under it and logs each new step once. Against a real aiohttp server
on 127.0.0.1 that answers ``/v1/models`` 503 ``not_serving`` and serves ``/v1/cluster/events``,
as the local agent does; offscreen."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

from agent.protocol.cluster_view import ClusterView, NodeInfo, NodeStep, Preparation
from agent.protocol.events import Event, Preparing, Snapshot
from gui.chat import preparing
from gui.chat.store import Store
from gui.chat.window import ChatWindow
from gui.client import Client
from gui.nodemap import NodeMapWindow, node_lines
from tests.support.fake_agent import FULL, FakeCoordinator
from tests.support.qt import run
from tests.support.wait import async_wait_until

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m"
A = NodeInfo("aaa", "ann", "127.0.0.1:7700", "coordinator", "available")
B = NodeInfo("bbb", "bob", "127.0.0.1:7710", "follower", "available")
VIEW = ClusterView("office", "aaa", 2, MODEL, "assigning", nodes=(A, B))
EXPORT_1 = Preparation(MODEL, "exporting", 0, 3, 10.0, "reading tensors", nodes=(NodeStep("aaa", "waiting"),))
EXPORT_2 = Preparation(MODEL, "exporting", 1, 3, 40.0, "compressing weights", nodes=(NodeStep("aaa", "waiting"),))
COMPILING = Preparation(MODEL, "compiling", nodes=(NodeStep("aaa", "compiling"), NodeStep("bbb", "ready")))


class Preparing503(FakeCoordinator):
    """A local agent whose coordinator prepares: ``/v1/models`` says ``not_serving`` (with the
    coordinator's words) until ``serving``; ``/v1/cluster/events`` sends a snapshot with the
    preparation, then whatever the test puts in ``events``."""

    def __init__(self) -> None:
        super().__init__()
        self.serving = False
        self.view = replace(VIEW, preparing=EXPORT_1)
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.subscribers = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._maybe_models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/cluster/events", self._events)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def _maybe_models(self, request: web.Request) -> web.Response:
        if self.serving:
            return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        said = f"the coordinator is preparing {MODEL}: exporting stage 1 of 3, 10%"
        return web.json_response(
            {"error": {"message": said, "type": "server_error", "code": "not_serving"}}, status=503
        )

    async def _events(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.subscribers += 1
        await ws.send_str(Snapshot(time.time(), self.view).to_json())
        closed = asyncio.ensure_future(ws.receive())  # (readers send nothing: this is their close)
        while True:
            nxt = asyncio.ensure_future(self.events.get())
            await asyncio.wait({nxt, closed}, return_when=asyncio.FIRST_COMPLETED)
            if closed.done():
                nxt.cancel()
                return ws
            await ws.send_str(nxt.result().to_json())

    def say(self, prep: Preparation) -> None:
        self.view = replace(self.view, preparing=prep)
        self.events.put_nowait(Preparing(time.time(), prep))


@pytest.fixture
def agent(qloop: asyncio.AbstractEventLoop) -> Iterator[Preparing503]:
    f = Preparing503()
    run(qloop, f.start())
    yield f
    run(qloop, f.stop())


@pytest.fixture
def window(qloop: asyncio.AbstractEventLoop, agent: Preparing503, tmp_path: Path) -> Iterator[Callable[[], ChatWindow]]:
    """The chat window on ``agent``, made in the test itself (pytest-qt processes Qt events
    between setup and call, which would run the window's tasks outside the running loop)."""
    made: list[ChatWindow] = []

    def make() -> ChatWindow:
        made.append(ChatWindow(Client(agent.url), Store(tmp_path / "chat.sqlite3")))
        return made[-1]

    yield make
    for w in made:
        run(qloop, w.async_stop())
        w.close()
        w.store.close()
        run(qloop, w.client.close())


def test_the_chat_banner_follows_the_preparation_live_and_goes_when_ready(
    qloop: asyncio.AbstractEventLoop, agent: Preparing503, window: Callable[[], ChatWindow]
) -> None:
    w = window()
    run(
        qloop,
        async_wait_until(
            lambda: "Preparing smollm2-135m: exporting stage 1 of 3" in w.banner.text(), what="the first step"
        ),
    )
    assert w.banner.isVisibleTo(w) and w.reachable is False and w.model.count() == 0
    assert "No coordinator is reachable" not in w.banner.text()  # one answers: it prepares
    assert w.model.placeholderText() == "smollm2-135m" and "first start can take several minutes" in w.banner.text()

    agent.say(EXPORT_2)
    run(
        qloop,
        async_wait_until(
            lambda: "exporting stage 2 of 3 (compressing weights), 40%" in w.banner.text(), what="the next stage"
        ),
    )
    assert w.prep_bar.isVisibleTo(w) and w.prep_bar.value() == 40

    w.input.setPlainText("Say hello.")  # typed while it prepares: kept, and sent once ready
    w.send_btn.click()
    assert w.pending_send and "will be sent" in w.banner.text() and w.store.messages(w.conversation or 0) == []

    agent.say(COMPILING)
    run(
        qloop,
        async_wait_until(
            lambda: "Preparing smollm2-135m: compiling on 2 nodes (1 ready)" in w.banner.text(), what="compiling"
        ),
    )
    assert not w.prep_bar.isVisibleTo(w)  # (no percent to show)

    agent.serving = True
    agent.say(Preparation(MODEL, "ready", nodes=(NodeStep("aaa", "ready"), NodeStep("bbb", "ready"))))
    run(qloop, async_wait_until(lambda: w.reachable and w.model.currentText() == MODEL, 10, what="the model list"))
    assert not w.banner.isVisibleTo(w) and not w.prep_bar.isVisibleTo(w)
    run(
        qloop,
        async_wait_until(
            lambda: len(w.store.messages(w.conversation or 0)) == 2 and w.streaming is None, what="the answer"
        ),
    )
    assert [m.content for m in w.store.messages(w.conversation or 0)] == ["Say hello.", FULL]


def test_a_failed_preparation_says_why_and_what_to_do(
    qloop: asyncio.AbstractEventLoop, agent: Preparing503, window: Callable[[], ChatWindow]
) -> None:
    w = window()
    run(qloop, async_wait_until(lambda: "exporting stage 1 of 3" in w.banner.text(), what="the first step"))
    agent.say(Preparation(MODEL, "failed", error="exporting stage 1 of 3 failed: MemoryError"))
    run(qloop, async_wait_until(lambda: "could not prepare smollm2-135m" in w.banner.text(), what="the failure"))
    assert "MemoryError" in w.banner.text() and "Open logs folder" in w.banner.text()
    assert w.banner.property("kind") == preparing.ERROR and not w.prep_bar.isVisibleTo(w)
    assert w.banner.styleSheet() == w.theme.banner_style(preparing.ERROR)


def test_without_events_the_banner_says_what_the_api_said() -> None:
    text, style, pct = preparing.banner(None, "the coordinator is preparing smollm2-135m: sending the stages", True)
    assert text.startswith("The coordinator is preparing smollm2-135m: sending the stages.")
    assert "will be sent" in text and style == preparing.INFO and pct is None


def test_the_node_map_writes_each_nodes_step_and_logs_each_step_once(qapp) -> None:  # type: ignore[no-untyped-def]
    m = NodeMapWindow(Client("http://127.0.0.1:9"), me=lambda: "aaa")
    views = [
        replace(VIEW, preparing=EXPORT_1),
        replace(VIEW, preparing=EXPORT_2),
        replace(VIEW, preparing=replace(EXPORT_2, percent=45.0)),  # its percent alone: no log line
        replace(VIEW, preparing=COMPILING),
    ]
    m.on_event((Snapshot(1.0, views[0]), views[0]))
    for v in views[1:]:
        assert v.preparing is not None
        m.on_event((Preparing(2.0, v.preparing), v))
    steps = [line.split("  ", 1)[1] for line in m.log_lines if "smollm2-135m:" in line]
    assert steps == [
        "smollm2-135m: exporting stage 1 of 3 (reading tensors), 10%",
        "smollm2-135m: exporting stage 2 of 3 (compressing weights), 40%",
        "smollm2-135m: compiling on 2 nodes (1 ready)",
    ]
    assert node_lines(A, COMPILING.node("aaa"))[-1] == "compiling its stage…"
    assert node_lines(B, NodeStep("bbb", "sending", 40.0))[-1] == "downloading its stage, 40%"
    m.show_node("aaa")
    assert "compiling its stage" in m.details.text()
    m.close()
