"""The tray's pure parts: state -> icon, the status line, notifications about this laptop (the
cluster's: test_tray_notices.py), answers' Markdown, the conversation store, start-at-login
files, the icon build, and the GUI's import boundary."""

from __future__ import annotations

import ast
import plistlib
import struct
import time
from pathlib import Path

import pytest

from agent.protocol.status import NodeStatus, PauseReason
from gui import autostart
from gui.chat.markdown import render
from gui.chat.store import Store
from gui.chat.theme import from_colours
from gui.state import TrayState, notices, reason_kind, status_line, tray_state

REPO = Path(__file__).resolve().parents[3]
STAGE = {"assigned": True, "layers": [12, 24], "model": "qwen2.5-coder-1.5b"}
NODE = {
    "node": "n1",
    "state": "available",
    "reason": None,
    "role": "follower",
    "coordinator": "c1",
    "peers": 3,
    "tok_s": 0.0,
    "stage": {"assigned": False},
}


def _n(**kw: object) -> NodeStatus:
    """The agent's /v1/node with these fields, read as the tray reads it."""
    return NodeStatus.parse({**NODE, **kw})


@pytest.mark.parametrize(
    ("node", "error", "state"),
    [
        (None, "config.yaml: port: 'x' is not a port number", TrayState.ERROR),
        (_n(), "lost", TrayState.ERROR),
        (None, None, TrayState.NO_CLUSTER),  # starting
        (_n(coordinator=None), None, TrayState.NO_CLUSTER),  # an election under way, or alone
        (_n(), None, TrayState.AVAILABLE),
        (_n(stage=STAGE), None, TrayState.AVAILABLE),  # holds a stage, idle
        (_n(stage=STAGE, tok_s=31.0), None, TrayState.SERVING),
        (_n(tok_s=31.0), None, TrayState.AVAILABLE),  # a rate without a stage is stale
        (_n(role="coordinator", coordinator="n1"), None, TrayState.COORDINATOR),
        (_n(role="coordinator", coordinator="n1", stage=STAGE, tok_s=5.0), None, TrayState.SERVING),
        (_n(state="limited", reason="91 C"), None, TrayState.LIMITED),
        (_n(state="paused", reason="user"), None, TrayState.PAUSED_USER),
        (_n(state="paused", reason="user active 4 s ago"), None, TrayState.PAUSED_USER),
        (_n(state="paused", reason="92 C"), None, TrayState.PAUSED_HEAT),
        (_n(state="paused", reason="on battery (18%)"), None, TrayState.PAUSED_HEAT),
        (_n(state="paused", reason="heat: 95 C"), None, TrayState.PAUSED_HEAT),
        (_n(state="paused", reason="user", coordinator=None), None, TrayState.PAUSED_USER),  # paused wins
        (_n(state="no_cluster", coordinator=None, role="no_cluster"), None, TrayState.NO_CLUSTER),  # no credentials
    ],
)
def test_the_icon_says_the_state_at_a_glance(node: NodeStatus | None, error: str | None, state: TrayState) -> None:
    assert tray_state(node, error) is state


@pytest.mark.parametrize(
    ("reason", "kind"),
    [(None, ""), ("user", "user"), ("user active 4 s ago", "user"), ("92 C", "heat"), ("on battery", "heat")],
)
def test_an_older_agents_reasons_sort_into_user_and_heat_or_battery_by_their_words(
    reason: str | None, kind: str
) -> None:
    assert reason_kind(reason) == kind


@pytest.mark.parametrize(
    ("state", "reason", "kind", "icon"),
    [
        ("paused", "92 C", "heat", TrayState.PAUSED_HEAT),
        ("paused", "on battery", "battery", TrayState.PAUSED_HEAT),
        ("paused", "Akku bei 18%", "battery", TrayState.PAUSED_HEAT),  # words the old guess misses
        ("paused", "user active", "input", TrayState.PAUSED_USER),
        ("paused", "user", "switch", TrayState.PAUSED_USER),
        ("paused", "lid closed", "lid", TrayState.PAUSED_USER),
        ("paused", "outside the hours set for contributing", "schedule", TrayState.PAUSED_USER),
        ("paused", "power saving mode", "switch", TrayState.PAUSED_USER),  # words the old guess takes for heat
        ("paused", "cooling down", "a-kind-from-a-newer-agent", TrayState.PAUSED_USER),  # other: not news
        ("paused", "92 C", None, TrayState.PAUSED_HEAT),  # an older agent: its words decide
        ("paused", "user active", None, TrayState.PAUSED_USER),
        ("limited", "other programs use 70% CPU", "load", TrayState.LIMITED),
        ("limited", "other programs use 60% of the GPU", "gpu", TrayState.LIMITED),
    ],
)
def test_the_paused_icon_follows_the_agents_reason_kind(
    state: str, reason: str, kind: str | None, icon: TrayState
) -> None:
    assert tray_state(_n(state=state, reason=reason, reason_kind=kind)) is icon


def test_the_menu_offers_resume_only_for_the_users_own_pause() -> None:
    from gui.state import paused_by_user

    assert paused_by_user(_n(state="paused", reason="user", reason_kind="switch"))
    assert paused_by_user(_n(state="paused", reason="user"))  # an older agent
    assert not paused_by_user(_n(state="paused", reason="user active", reason_kind="input"))
    assert not paused_by_user(_n(state="paused", reason="user", reason_kind="heat"))  # the kind decides
    assert not paused_by_user(_n()) and not paused_by_user(None)


def test_heat_news_follows_the_kind_not_the_words() -> None:
    battery = _n(state="paused", reason="Akku bei 18%", reason_kind="battery")
    assert [n.text for n in notices(_n(), battery)] == [
        "This laptop was paused: Akku bei 18%. Its work moved to other laptops."
    ]
    assert notices(_n(), _n(state="paused", reason="power saving mode", reason_kind="switch")) == []
    assert NodeStatus.parse({**NODE, "reason_kind": "heat"}).reason_kind is PauseReason.HEAT


def test_every_state_has_its_own_icon_that_renders_at_16_px(qapp) -> None:  # type: ignore[no-untyped-def]
    from gui.icons import icon_path, state_icon

    files = {icon_path(s) for s in TrayState}
    assert len(files) == len(TrayState)
    images = set()
    for s in TrayState:
        assert icon_path(s).is_file(), s
        img = state_icon(s).pixmap(16, 16).toImage()
        assert img.width() == 16
        images.add(bytes(img.constBits()))  # type: ignore[call-overload]
    assert len(images) == len(TrayState)  # all different, even at 16 px


@pytest.mark.parametrize(
    ("node", "line"),
    [
        (None, "starting the agent…"),
        (_n(stage=STAGE), "serving layers 12-23 of qwen2.5-coder-1.5b, 3 peers"),
        (
            _n(stage=STAGE, role="coordinator", peers=1),
            "coordinator, serving layers 12-23 of qwen2.5-coder-1.5b, 1 peer",
        ),
        (_n(), "idle, 3 peers"),
        (_n(coordinator=None, peers=0), "no cluster yet (looking for peers), 0 peers"),
        (_n(state="no_cluster", coordinator=None), "not in a cluster yet: create one or join one"),
        (
            _n(state="no_cluster", error="the data port is taken"),
            "not in a cluster yet: create one or join one (last try: the data port is taken)",
        ),
        (_n(state="paused", reason="user", paused_until=None), "paused until you resume, 3 peers"),
        (_n(state="paused", reason="92 C"), "paused: 92 C, 3 peers"),
        (
            _n(state="limited", reason="user active", stage=STAGE),
            "limited (user active), serving layers 12-23 of qwen2.5-coder-1.5b, 3 peers",
        ),
    ],
)
def test_the_status_line(node: NodeStatus | None, line: str) -> None:
    assert status_line(node) == line


def test_cluster_membership_from_the_agents_node() -> None:
    from gui.state import holds_ca, waiting_for_cluster

    assert waiting_for_cluster(_n(state="no_cluster"))
    assert not waiting_for_cluster(_n()) and not waiting_for_cluster(None)
    assert holds_ca(_n(holds_ca=True)) and not holds_ca(_n()) and not holds_ca(None)
    assert not holds_ca(_n(state="no_cluster", holds_ca=True))


def test_a_timed_pause_says_until_when() -> None:
    until = time.time() + 3600
    assert status_line(_n(state="paused", reason="user", paused_until=until)).startswith(
        "paused until " + time.strftime("%H:%M", time.localtime(until))
    )
    assert status_line(None, "port 7701 is taken") == "error: port 7701 is taken"


@pytest.mark.parametrize(
    ("before", "after", "texts"),
    [
        (None, _n(state="paused", reason="92 C"), []),  # nothing to compare with yet
        (_n(), _n(state="paused", reason="user"), []),  # the user did it: no news to them
        (_n(), _n(state="paused", reason="92 C"), ["This laptop was paused: 92 C. Its work moved to other laptops."]),
        (
            _n(),
            _n(state="limited", reason="on battery"),
            ["This laptop is contributing less: on battery. Its work moved to other laptops."],
        ),
        (_n(state="paused", reason="92 C"), _n(), ["This laptop contributes again."]),
        (_n(state="paused", reason="user"), _n(), []),
        (_n(state="paused", reason="92 C"), _n(state="paused", reason="92 C"), []),
        (_n(), _n(state="paused", reason="user active"), []),  # they know: they are typing
        (_n(state="paused", reason="user active"), _n(), []),
    ],
)
def test_notifications_for_this_laptop(before: NodeStatus | None, after: NodeStatus | None, texts: list[str]) -> None:
    assert [n.text for n in notices(before, after)] == texts


def test_answers_render_markdown_with_a_copy_link_per_code_block_and_no_raw_html() -> None:
    text = "Use **this**:\n\n```python\nprint(1 < 2)\n```\n\n<script>alert(1)</script>\n\n```\nls -l\n```\n"
    html, blocks = render(text, from_colours("#000000", "#ffffff", "#0000ff", "#308cc6"), first=3)
    assert blocks == ["print(1 < 2)", "ls -l"]
    assert 'href="copy:3"' in html and 'href="copy:4"' in html
    assert "<strong>this</strong>" in html and ">print</span>" in html and "&lt;" in html  # (highlighted)
    assert '<pre style="color:#000000">ls -l</pre>' in html  # (no language: plain)
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_conversations_and_drafts_survive_a_restart(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite3"
    s = Store(db)
    cid = s.create(system_prompt="Be brief.", model="smollm2-135m")
    s.add(cid, "user", "What is a shard?")
    mid = s.add(cid, "assistant", "")
    s.update(mid, "A piece.", {"ttft_s": 0.2, "nodes": ["a", "b"]})
    s.set_draft(cid, "and a pipeline?")
    other = s.create()
    s.rename(other, "  Second   one ")
    s.close()
    s = Store(db)
    convs = {c.id: c for c in s.conversations()}
    assert convs[cid].title == "What is a shard?" and convs[cid].draft == "and a pipeline?"
    assert convs[other].title == "Second one"
    assert s.history(cid) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a shard?"},
        {"role": "assistant", "content": "A piece."},
    ]
    assert s.messages(cid)[1].stats == {"ttft_s": 0.2, "nodes": ["a", "b"]}
    s.delete(cid)
    assert [c.id for c in s.conversations()] == [other] and s.messages(cid) == []


def test_start_at_login_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "sys"))  # no system-wide entry here
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cmd = ["/opt/lakeshard/bin/python", "-m", "agent", "tray"]
    where = autostart.set_enabled(True, cmd, platform="linux")
    f = tmp_path / "cfg" / "autostart" / "lakeshard.desktop"
    assert where == str(f) and autostart.is_enabled("linux")
    text = f.read_text()
    assert "Exec=/opt/lakeshard/bin/python -m agent tray" in text and "Type=Application" in text
    autostart.set_enabled(False, cmd, platform="linux")
    assert not f.exists() and not autostart.is_enabled("linux")
    autostart.set_enabled(True, cmd, platform="darwin")
    plist = plistlib.loads(autostart.launch_agent_file().read_bytes())
    assert plist["ProgramArguments"] == cmd and plist["RunAtLoad"] is True
    autostart.set_enabled(False, cmd, platform="darwin")
    assert not autostart.is_enabled("darwin")
    assert autostart.windows_run_value([r"C:\Program Files\lakeshard\python.exe", "-m", "agent", "tray"]) == (
        r'"C:\Program Files\lakeshard\python.exe" -m agent tray'
    )


def test_the_icon_build_makes_pngs_an_ico_and_an_icns(qapp, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_icons", REPO / "assets" / "build_icons.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.build(out=tmp_path)
    for state in TrayState:
        for size in (16, 32, 256):
            png = (tmp_path / "png" / f"{state.value}-{size}.png").read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n"
            assert struct.unpack(">II", png[16:24]) == (size, size)
    ico = (tmp_path / "lakeshard.ico").read_bytes()
    reserved, kind, count = struct.unpack("<HHH", ico[:6])
    assert (reserved, kind, count) == (0, 1, len(mod.ICO_SIZES))
    sizes = sorted(ico[6 + 16 * i] or 256 for i in range(count))
    assert sizes == sorted(mod.ICO_SIZES)
    icns = (tmp_path / "lakeshard.icns").read_bytes()
    assert icns[:4] == b"icns" and struct.unpack(">I", icns[4:8])[0] == len(icns)
    kinds, i = [], 8
    while i < len(icns):
        kinds.append(icns[i : i + 4])
        i += struct.unpack(">I", icns[i + 4 : i + 8])[0]
    assert kinds == [b"icp4", b"icp5", b"icp6", b"ic07", b"ic08", b"ic09"]
    # the committed copies are there for installers
    for f in ("lakeshard.ico", "lakeshard.icns", "png/available-16.png", "png/no-cluster-256.png"):
        assert (REPO / "assets" / "icons" / f).is_file(), f


def test_the_gui_talks_to_the_cluster_only_through_its_apis() -> None:
    """gui/ imports nothing of agent/ or coordinator/ but the shared protocol types."""
    offenders = []
    for f in (REPO / "gui").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                top = n.split(".")[0]
                if top in ("agent", "coordinator") and not n.startswith("agent.protocol"):
                    offenders.append(f"{f.relative_to(REPO)}: {n}")
    assert offenders == []
