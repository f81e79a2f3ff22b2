"""The tray app against real local clusters (agent processes on loopback), offscreen.

Chat: answers stream through a laptop's own agent from a coordinator on another, equal to
what the API gives; Stop ends the generation on the cluster; conversations survive a restart;
with no coordinator the window says so, keeps the message and sends it once one answers.
Tray and node map: the menu's pause switch, a node pausing and a node dying shown within 2 s,
and the notifications when the coordinator is lost and another elected.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.protocol.events import Event, Snapshot, StreamFinished, StreamStarted
from coordinator.lab.local_cluster import LocalCluster, free_port
from gui.chat.store import Store
from gui.chat.window import ChatWindow
from gui.client import Client
from gui.state import COORDINATOR
from gui.tray import TrayApp
from tests.support.figures import report
from tests.support.qt import run
from tests.support.served import post_chat
from tests.support.wait import async_wait_until, wait_until

pytestmark = pytest.mark.timeout(900)


def _api(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def _get(url: str) -> dict[str, Any]:
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        d: dict[str, Any] = json.loads(r.read())
        return d


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    import json
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        d: dict[str, Any] = json.loads(r.read())
        return d


def _serving(port: int) -> bool:
    try:
        _get(f"{_api(port)}/v1/models")
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def served2(smollm2) -> Iterator[LocalCluster]:  # type: ignore[no-untyped-def]
    """Two elected agents that serve SmolLM2 (f32 activations: exactly comparable answers), over
    both laptops (pinned: left to itself, the planner may put so small a model on one)."""
    c = LocalCluster(
        2,
        elect=["--serve-model", "smollm2-135m", "--serve-weights", "int8", "--serve-exact"],
        config="serve:\n  min_nodes: 2\n",
    ).start()
    try:
        wait_until(lambda: all(_serving(p) for p in c.api_ports), 600, what="the cluster to serve", step=0.5)
        yield c
    finally:
        c.stop()


def _logs(c: LocalCluster, lines: int = 40) -> str:
    """The last lines of every agent's log, for a failure's message."""
    out = []
    for i in range(len(c.api_ports)):
        for f in sorted((c.home(i) / "logs").glob("*.log")):
            out.append(f"--- {f.name}")
            out += f.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(out)


def _far_agent(c: LocalCluster) -> tuple[int, int]:
    """(an agent whose coordinator runs on another agent, the coordinator's agent), as API ports."""
    here = [_get(f"{_api(p)}/v1/cluster")["gateway"]["here"] for p in c.api_ports]
    coord = c.api_ports[here.index(True)]
    far = c.api_ports[here.index(False)]
    return far, coord


def test_chat_streams_the_apis_answer_and_stop_cancels_it_on_the_cluster(
    qloop: asyncio.AbstractEventLoop, served2: LocalCluster, tmp_path: Path
) -> None:
    far, coord = _far_agent(served2)
    db = tmp_path / "conversations.sqlite3"
    w = ChatWindow(Client(_api(far)), Store(db))
    w.show()
    pieces: list[tuple[float, str]] = []
    w.chunk.connect(lambda s: pieces.append((time.monotonic(), s)))
    question = "What is the capital of France? Tell me about the city."

    async def ask(text: str) -> None:
        w.input.setPlainText(text)
        w.send()
        await async_wait_until(lambda: w.streaming is None and w.live is None, 120, what="the answer")

    run(qloop, async_wait_until(lambda: w.reachable and w.model.count() > 0, 60, what="the coordinator"))
    assert w.model.currentText() == "smollm2-135m"
    w.system.setPlainText("You are a helpful assistant.")
    run(qloop, ask(question), 180)
    cid = w.conversation
    assert cid is not None
    msgs = w.store.messages(cid)
    answer = msgs[-1]
    assert answer.role == "assistant" and len(answer.content) > 20
    assert len(pieces) > 5 and pieces[0][0] < pieces[-1][0]  # it streamed, piece by piece
    # the same conversation straight to the API (through the coordinator's own agent)
    body = {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": question},
        ],
        "temperature": 0.0,
        "max_tokens": 1024,
    }
    status, direct = post_chat(_api(coord), body)
    assert status == 200
    assert answer.content == direct["choices"][0]["message"]["content"]
    assert answer.stats["ttft_s"] > 0 and answer.stats["tok_s"] > 0
    assert answer.stats["tokens"] == direct["usage"]["completion_tokens"]
    assert len(answer.stats["nodes"]) == 2  # served by both laptops
    assert w.windowTitle() and w.store.get(cid).title == question[:60]  # type: ignore[union-attr]
    # each stage times its link to the next agent of the ring, which node maps label
    for p in served2.api_ports:
        st = _get(f"{_api(p)}/v1/node")["stage"]
        assert st["assigned"] and st["next_rtt_ms"] is not None and 0 < st["next_rtt_ms"] < 1000, st

    # Stop: the request closes, and the coordinator ends the stream after a few tokens
    events: list[Event] = []

    watching = Client(_api(coord))

    async def watch() -> None:
        async for ev in watching.events():
            events.append(ev)

    watcher = asyncio.ensure_future(watch(), loop=qloop)
    # subscribed (its snapshot is in) before the stream starts, so none of its events is missed
    run(qloop, async_wait_until(lambda: any(isinstance(e, Snapshot) for e in events), 30, what="the event stream"))
    pieces.clear()
    w.input.setPlainText("Write a very long story about a dragon who learns to cook. Use many chapters.")
    w.send()
    run(qloop, async_wait_until(lambda: len(pieces) >= 3, 60, what="a few pieces"))
    started = run(
        qloop,
        async_wait_until(lambda: [e.stream for e in events if isinstance(e, StreamStarted)], 10, what="its start"),
    )
    assert len(started) == 1, events
    stopped_at = time.monotonic()
    w.stop()

    def ended() -> list[StreamFinished]:
        return [e for e in events if isinstance(e, StreamFinished) and e.stream == started[0]]

    fin = run(
        qloop,
        async_wait_until(
            ended,
            10,
            what="the stream to end on the coordinator",
            diagnose=lambda: f"seen {[x for x in events if not isinstance(x, Snapshot)]}\n{_logs(served2)}",
        ),
    )
    assert fin[-1].outcome == "cancelled", fin
    assert time.monotonic() - stopped_at < 5
    assert 3 <= fin[-1].tokens < 200
    run(qloop, async_wait_until(lambda: w.streaming is None, what="the window to settle"))
    assert w.store.messages(cid)[-1].stats.get("stopped") is True
    watcher.cancel()
    run(qloop, watching.close())

    # conversations (and the unsent draft) survive a restart of the window
    w.input.setPlainText("an unsent thought")
    w._save_draft()
    w.rename(cid, "About Paris")
    run(qloop, w.async_stop())
    w.close()
    w.store.close()
    run(qloop, w.client.close())
    w2 = ChatWindow(Client(_api(far)), Store(db))
    assert w2.conversation == cid and w2.input.toPlainText() == "an unsent thought"
    assert [c.title for c in w2.store.conversations()] == ["About Paris"]
    assert [m.content for m in w2.store.messages(cid)][:2] == [question, answer.content]
    assert w2.system.toPlainText() == "You are a helpful assistant."
    run(qloop, w2.async_stop())
    w2.close()
    run(qloop, w2.client.close())


def test_with_no_coordinator_the_chat_says_so_keeps_the_message_and_sends_it_later(
    qloop: asyncio.AbstractEventLoop, served2: LocalCluster, tmp_path: Path
) -> None:
    far, _ = _far_agent(served2)
    nobody = _api(free_port())
    client = Client(_api(far), coordinator_url=nobody)
    w = ChatWindow(client, Store(tmp_path / "c.sqlite3"))
    run(qloop, async_wait_until(lambda: w.reachable is False and w.banner.isVisibleTo(w), 20, what="the banner"))
    w.input.setPlainText("Say hello.")
    w.send()
    assert w.input.toPlainText() == "Say hello." and w.pending_send
    assert "will be sent" in w.banner.text() and w.store.messages(w.conversation or 0) == []
    # the coordinator becomes reachable (as after an election, or a corrected setting)
    client.coordinator_url = _api(far)
    run(
        qloop,
        async_wait_until(lambda: len(w.store.messages(w.conversation or 0)) == 2, 30, what="the message to go out"),
    )
    run(qloop, async_wait_until(lambda: w.streaming is None and w.live is None, 120, what="its answer"))
    msgs = w.store.messages(w.conversation or 0)
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[0].content == "Say hello."
    assert msgs[1].content and not w.banner.isVisibleTo(w) and w.input.toPlainText() == ""
    run(qloop, w.async_stop())
    run(qloop, client.close())


def _settled(c: LocalCluster, timeout: float = 60.0) -> str:
    """Wait until every agent hears all the others and follows one coordinator; its node id."""
    n = len(c.api_ports) - 1

    def settled(views: list[dict[str, Any]]) -> bool:
        leaders = {v["coordinator"] for v in views}
        return (
            len(leaders) == 1
            and None not in leaders
            and all(len([p for p in v["peers"] if p["alive"]]) == n for v in views)
        )

    views = wait_until(
        lambda: [_get(f"{_api(p)}/v1/cluster") for p in c.api_ports],
        timeout,
        what="every agent to hear the others and follow one coordinator",
        ok=settled,
        step=0.25,
    )
    return str(views[0]["coordinator"])


@pytest.fixture(scope="module")
def plain4() -> Iterator[LocalCluster]:
    """Four elected agents with no model: the node map and the tray need only the event stream."""
    c = LocalCluster(4, elect=[]).start()
    try:
        _settled(c)
        yield c
    finally:
        c.stop()


def test_the_tray_menu_pauses_and_resumes_this_laptop(qloop: asyncio.AbstractEventLoop, plain4: LocalCluster) -> None:
    c = plain4
    quits: list[bool] = []
    tray = TrayApp(Client(_api(c.api_ports[0])), poll_s=0.2, on_quit=lambda: quits.append(True))
    tray.start()
    try:
        run(qloop, async_wait_until(lambda: tray.node is not None, 20, what="the agent's state"))
        tray.build_menu()
        assert tray.menu.actions()[0].text() == tray_status(tray)
        pause = tray.action("For 1 hour")
        assert pause is not None and tray.action("Resume contributing") is None
        t0 = time.time()
        pause.trigger()
        run(qloop, async_wait_until(lambda: tray.node is not None and tray.node.state == "paused", 10, what="paused"))
        assert tray.node is not None and abs((tray.node.paused_until or 0) - (t0 + 3600)) < 30
        assert tray.state.value == "paused-user"
        tray.build_menu()
        assert tray.menu.actions()[0].text().startswith("paused until ")
        resume = tray.action("Resume contributing")
        assert resume is not None and tray.action("For 1 hour") is None
        resume.trigger()
        run(
            qloop,
            async_wait_until(lambda: tray.node is not None and tray.node.state == "available", 10, what="available"),
        )
        tray.build_menu()
        until_resumed = tray.action("Until I resume")
        assert until_resumed is not None
        until_resumed.trigger()
        run(qloop, async_wait_until(lambda: tray.node is not None and tray.node.state == "paused", 10, what="paused"))
        assert tray.node is not None and tray.node.paused_until is None
        assert _get(f"{_api(c.api_ports[0])}/v1/node")["state"] == "paused"  # the agent itself, not only the icon
        tray.build_menu()
        tray.action("Resume contributing").trigger()  # type: ignore[union-attr]
        run(
            qloop,
            async_wait_until(lambda: tray.node is not None and tray.node.state == "available", 10, what="available"),
        )
        tray.build_menu()
        tray.action("Quit").trigger()  # type: ignore[union-attr]
        assert quits == [True]
    finally:
        run(qloop, tray.async_stop())


def tray_status(tray: TrayApp) -> str:
    from gui.state import status_line

    return status_line(tray.node, tray.error)


def test_the_node_map_shows_a_node_pausing_and_dying_within_2_s_and_the_tray_a_new_coordinator(
    qloop: asyncio.AbstractEventLoop, plain4: LocalCluster
) -> None:
    from PySide6.QtCore import QPoint, Qt
    from PySide6.QtTest import QTest

    c = plain4
    nodes = {p: _get(f"{_api(p)}/v1/node")["node"] for p in c.api_ports}
    coord = _settled(c)  # (the menu's test paused one of them: it may have handed over)
    by_id = {v: p for p, v in nodes.items()}
    others = [p for p in c.api_ports if nodes[p] != coord]
    mine, victim = others[0], others[1]
    tray = TrayApp(Client(_api(mine)), poll_s=0.2)
    tray.start()
    try:
        tray.show_map()
        m = tray.map
        m.resize(1100, 700)
        run(
            qloop,
            async_wait_until(
                lambda: m.view is not None and len(m.view.nodes) == 4, 20, what="all four nodes on the map"
            ),
        )
        assert m.view.coordinator == coord
        # the map is a picture of them: click the victim's box for its details
        m.canvas.grab()
        box = m.canvas.boxes()[nodes[victim]]
        QTest.mouseClick(m.canvas, Qt.MouseButton.LeftButton, pos=QPoint(int(box.center().x()), int(box.center().y())))
        assert m.selected == nodes[victim] and nodes[victim] in m.details.text()
        assert not m.pause_btn.isEnabled()  # another laptop: not from here without credentials
        m.show_node(nodes[mine])
        assert m.pause_btn.isEnabled()

        t0 = time.monotonic()
        _post(f"{_api(victim)}/v1/node/state", {"state": "paused"})
        run(
            qloop,
            async_wait_until(lambda: m.view.node(nodes[victim]).state == "paused", 5, what="the pause on the map"),
        )  # type: ignore[union-attr]
        paused_s = time.monotonic() - t0
        assert paused_s < 2.0, paused_s
        m.canvas.grab()

        t0 = time.monotonic()
        c.kill(c.api_ports.index(victim))
        run(qloop, async_wait_until(lambda: m.view.node(nodes[victim]) is None, 5, what="the death on the map"))  # type: ignore[union-attr]
        died_s = time.monotonic() - t0
        assert died_s < 2.0, died_s
        assert any("left" in line for line in m.log_lines)
        report(f"node map: a node's pause shown after {paused_s:.2f} s, its death after {died_s:.2f} s")

        # the coordinator dies: the tray names the one elected instead (a loss alone is told only
        # when no coordinator comes within the grace; then a follow-up names the new one)
        c.kill(c.api_ports.index(by_id[coord]))
        told = run(
            qloop,
            async_wait_until(
                lambda: [n for n in tray.shown if n.key == COORDINATOR and "coordinates" in n.text],
                25,
                what="a notice naming the new coordinator",
            ),
        )
        assert m.view is not None and m.view.coordinator in (nodes[mine], nodes[others[2]])
        assert tray.names.get(m.view.coordinator, m.view.coordinator) in told[-1].text
    finally:
        run(qloop, tray.async_stop())


def test_settings_are_checked_by_the_agent_written_and_applied(
    qloop: asyncio.AbstractEventLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gui.settings import SettingsDialog, load_tray_settings

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))  # start at login writes here
    monkeypatch.setenv("LAKESHARD_HOME", str(tmp_path / "tray"))  # the tray's own settings
    with LocalCluster(1, elect=[]) as c:
        api = _api(c.api_ports[0])
        me = _get(f"{api}/v1/node")["node"]
        client = Client(api)
        d = SettingsDialog(client)
        run(qloop, d.async_load())
        first = _get(f"{api}/v1/settings")
        assert not first["exists"] and d.cluster.text() == "default"
        # what runs: the data port given on the agent's command line, marked as not the file's
        assert d.port.value() == c.ports[0] != 7700
        assert first["effective"]["port"] == c.ports[0] and first["from_file"]["port"] == 7700
        assert d.rows["port"][0].toolTip().startswith(f"The agent runs with {c.ports[0]}; the file says 7700")

        # a bad value is the agent's own error, and nothing is written
        d.tabs.setCurrentIndex(d.advanced_tab)
        d.text.setPlainText("port: not-a-port\n")
        assert run(qloop, d.async_save()) is False
        assert "port: 'not-a-port' is not a port number" in d.message.text()
        assert not _get(f"{api}/v1/settings")["exists"]

        # the form: a model to serve, a log level, start at login, a coordinator URL for the chat
        d.tabs.setCurrentIndex(0)
        d.model.setEditText("smollm2-135m")
        d.log_level.setCurrentText("info")
        d.autostart.setChecked(True)
        d.coordinator_url.setText("http://10.0.0.5:8000")
        d.idle_minutes.setValue(5)
        d.temp_high.setValue(85)
        assert run(qloop, d.async_save()) is True
        saved = _get(f"{api}/v1/settings")
        assert saved["settings"] == {  # what was changed: not the values shown as they run (the ports, ...)
            "serve": {"model": "smollm2-135m"},
            "log_level": "info",
            "throttle": {"idle_minutes": 5.0, "temp_high_c": 85},
        }
        assert "Override model applies after the agent restarts" in d.message.text()
        assert (tmp_path / "xdg" / "autostart" / "lakeshard.desktop").is_file()
        assert load_tray_settings()["coordinator_url"] == "http://10.0.0.5:8000"
        assert client.coordinator_url == "http://10.0.0.5:8000"  # the chat asks it from now on
        assert client.agent_url == api

        # the election's settings apply at once: excluded, this node stops standing for coordinator
        run(qloop, client.put_settings({**saved["settings"], "election": {"exclude": [me]}}))
        cluster = _get(f"{api}/v1/cluster")
        assert cluster["not_eligible_because"] == "excluded from coordinator duties by the cluster settings"

        # a pause for a while ends by itself; nonsense durations are refused
        for bad in (-1, 0, "soon", 10**9, float("nan")):
            req = {"state": "paused", "for_s": bad}
            status, body = _post_status(f"{api}/v1/node/state", req)
            assert status == 400 and "for_s" in body["error"]["message"], bad
        node = _post(f"{api}/v1/node/state", {"state": "paused", "for_s": 1.5})
        assert node["state"] == "paused" and node["reason"] == "user"
        wait_until(  # (the bound is the one the test always had: back within 3 s of a 1.5 s pause)
            lambda: _get(f"{api}/v1/node"),
            3.0,
            what="the pause to end by itself",
            ok=lambda n: n["state"] == "available",
        )
        run(qloop, client.close())


def _post_status(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import json
    import urllib.error

    try:
        return 200, _post(url, body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
