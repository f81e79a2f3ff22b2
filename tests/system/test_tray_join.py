"""The tray makes, joins, invites and revokes (issue 26), against real agents on loopback, offscreen.

Two agents start without credentials (each the other's static peer), so each waits for a
cluster. One tray offers Create/Join and creates a cluster; its Invite shows a token that the
CLI accepts in another home; the other tray's Join dialog shows the agent's one-line error for a
bad token, then joins with the good one and reaches a member state within seconds; finally the
first laptop's node map revokes the second.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.security import cluster
from coordinator.lab.local_cluster import free_port
from gui.client import Client
from gui.state import TrayState, waiting_for_cluster
from gui.tray import TrayApp
from tests.support.agents import Agent
from tests.support.cli import run_cli
from tests.support.figures import report
from tests.support.qt import run
from tests.support.wait import async_wait_until, wait_until

pytestmark = pytest.mark.timeout(300)
MEMBER_STATES = (TrayState.AVAILABLE, TrayState.COORDINATOR, TrayState.SERVING)


@pytest.fixture
def laptops(tmp_path: Path) -> Iterator[tuple[Agent, Agent]]:
    hp, jp = free_port(), free_port()
    h = Agent(tmp_path / "h", "--no-mdns", "--static-peers", f"127.0.0.1:{jp}", port=hp)
    j = Agent(tmp_path / "j", "--no-mdns", "--static-peers", f"127.0.0.1:{hp}", port=jp)
    try:
        wait_until(lambda: h.answers() and j.answers(), 60, what="both local APIs")
        yield h, j
    finally:
        h.stop()
        j.stop()


def test_the_tray_creates_joins_invites_and_revokes(
    qloop: asyncio.AbstractEventLoop, laptops: tuple[Agent, Agent], tmp_path: Path
) -> None:
    h, j = laptops
    asked: list[str] = []
    th = TrayApp(Client(f"http://127.0.0.1:{h.api}"), poll_s=0.2, confirm=lambda t, _x: asked.append(t) is None)
    tj = TrayApp(Client(f"http://127.0.0.1:{j.api}"), poll_s=0.2)
    th.start()
    tj.start()
    try:
        # no credentials: the icon says no cluster, the menu offers to make or join one
        run(
            qloop,
            async_wait_until(lambda: waiting_for_cluster(th.node) and waiting_for_cluster(tj.node), what="h waiting"),
        )
        assert th.state is TrayState.NO_CLUSTER and tj.state is TrayState.NO_CLUSTER
        th.build_menu()
        assert th.menu.actions()[0].text() == "not in a cluster yet: create one or join one"
        assert th.action("Create a new cluster…") and th.action("Join a cluster…")
        assert th.action("Invite a laptop…") is None

        # Create: h holds the new cluster's CA and runs as a member
        th.action("Create a new cluster…").trigger()  # type: ignore[union-attr]
        run(qloop, async_wait_until(lambda: th.node is not None and th.node.holds_ca, what="h a member"))
        assert asked == ["Create a new cluster"]
        assert any("holds its CA and is its first member" in n.text for n in th.shown), th.shown
        th.build_menu()
        assert th.action("Create a new cluster…") is None and th.action("Join a cluster…") is None

        # Invite: a token for two laptops, which the CLI accepts in another home
        th.action("Invite a laptop…").trigger()  # type: ignore[union-attr]
        inv = th.invite_dialog
        inv.expires.setCurrentText("1h")
        inv.uses.setValue(2)
        inv.make_btn.click()
        token = run(qloop, async_wait_until(lambda: inv.token.text(), what="a token"))
        assert token.startswith("lsj1-") and "2 uses" in inv.message.text() and inv.copy_btn.isEnabled()
        inv.copy_btn.click()
        r = run_cli("cluster", "join", token, env={"LAKESHARD_HOME": str(tmp_path / "other")}, timeout=60)
        assert r.returncode == 0 and "joined cluster" in r.stdout, r.stderr

        # Join on the other laptop: a bad token is the agent's one-line error, the good one joins
        tj.build_menu()
        tj.action("Join a cluster…").trigger()  # type: ignore[union-attr]
        jd = tj.join_dialog
        jd.token.setText("lsj1-AAAA")
        jd.join_btn.click()
        run(qloop, async_wait_until(lambda: jd.message.text().startswith("not joined"), what="the error"))
        assert "too short" in jd.message.text() and "\n" not in jd.message.text() and jd.isVisible()
        assert waiting_for_cluster(tj.node)
        jd.token.setText(token)
        t0 = time.monotonic()
        jd.join_btn.click()
        run(qloop, async_wait_until(lambda: not jd.isVisible(), what="the dialog to close"))
        run(qloop, async_wait_until(lambda: tj.state in MEMBER_STATES, 30, what="a member state"))
        took = time.monotonic() - t0
        assert took < 15, took
        report(f"tray join: a member state {took:.1f} s after Join (token checked over TLS, certificate issued)")
        tj.build_menu()
        assert tj.action("Join a cluster…") is None and tj.action("Invite a laptop…") is None  # not the CA holder
        assert tj.node is not None and tj.node.links == "TLS" and tj.node.api_port == j.api
        assert j.proc.poll() is None and len([x for x in j.lines if "not in a cluster" in x]) == 1

        # the node map on the CA holder revokes the other laptop (after a confirmation)
        hn, jn = th.node.node, tj.node.node  # type: ignore[union-attr]
        th.show_map()
        m = th.map
        run(
            qloop,
            async_wait_until(lambda: m.view is not None and len(m.view.nodes) == 2, 30, what="both nodes on the map"),
        )
        m.show_node(hn)
        assert not m.revoke_btn.isEnabled()  # not itself
        m.show_node(jn)
        assert m.revoke_btn.isEnabled()
        m.revoke_btn.click()
        run(qloop, async_wait_until(lambda: "revoked node" in m.note.text(), what="revoked"))
        assert asked[-1] == "Revoke a laptop" and jn in cluster.status(h.security)["revoked"]
        tj.show_map()  # the other laptop's map cannot revoke
        tj.map.show_node(hn)
        assert not tj.map.revoke_btn.isEnabled()
    finally:
        run(qloop, th.async_stop())
        run(qloop, tj.async_stop())
