"""The tray icon in a real tray host: Xvfb plus an XEmbed system tray (Debian's ``trayer``).

``lakeshard tray`` runs as a process of its own, as at login: its icon must be embedded in the
tray, its menu must open from a click (``xdotool``), a second launch must bring the running
one forward instead of starting another, and SIGTERM must quit it with the agent it started.
Skipped, with the reason, where those programs are missing (``.ci/run`` installs them).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.lab.local_cluster import free_port
from tests.support.cli import REPO
from tests.support.wait import wait_until
from tests.support.xserver import missing, xvfb

MISSING = missing("Xvfb", "trayer", "xdotool", "xwininfo", "import")
pytestmark = [
    pytest.mark.skipif(
        bool(MISSING), reason=f"needs {', '.join(MISSING)} (apt-get install xvfb trayer xdotool x11-utils imagemagick)"
    ),
    pytest.mark.timeout(240),
]


@pytest.fixture
def display(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An X server with an XEmbed system tray on it."""
    with xvfb() as xenv:
        env = {**xenv, "QT_QPA_PLATFORM": "xcb", "LAKESHARD_HOME": str(tmp_path / "home")}
        tray = subprocess.Popen(
            ["trayer", "--edge", "top", "--align", "right", "--widthtype", "request", "--height", "24"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            yield env
        finally:
            tray.terminate()
            tray.wait(10)


def _tree(env: dict[str, str]) -> str:
    return subprocess.run(["xwininfo", "-root", "-tree"], env=env, capture_output=True, text=True).stdout


def _embedded(env: dict[str, str]) -> tuple[int, int, int, int] | None:
    """Where the lakeshard icon sits inside trayer's panel (x, y, w, h), if it is embedded there."""
    text = _tree(env)
    i = text.find('"panel"')
    if i < 0:
        return None
    m = re.search(r'"lakeshard": \([^)]*\)\s+(\d+)x(\d+)\+-?\d+\+-?\d+\s+\+(-?\d+)\+(-?\d+)', text[i:])
    if m is None:
        return None
    w, h, x, y = map(int, m.groups())
    return x, y, w, h


def _visible_windows(env: dict[str, str]) -> list[tuple[int, int]]:
    out = subprocess.run(
        ["xdotool", "search", "--onlyvisible", "--class", "lakeshard"], env=env, capture_output=True, text=True
    )
    sizes = []
    for wid in out.stdout.split():
        info = subprocess.run(["xwininfo", "-id", wid], env=env, capture_output=True, text=True).stdout
        w = re.search(r"Width: (\d+)", info)
        h = re.search(r"Height: (\d+)", info)
        if w and h:
            sizes.append((int(w.group(1)), int(h.group(1))))
    return sizes


def test_the_tray_icon_embeds_opens_its_menu_and_stays_single(display: dict[str, str], tmp_path: Path) -> None:
    env = display
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "from PySide6.QtWidgets import QApplication, QSystemTrayIcon as T; "
            "a = QApplication([]); print(T.isSystemTrayAvailable())",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "could not load the qt platform plugin" in probe.stderr.lower():
        pytest.skip(f"Qt's xcb platform plugin cannot load here: {probe.stderr.strip().splitlines()[0]}")
    assert probe.stdout.strip() == "True", probe.stderr
    port, api = free_port(), free_port()
    cmd = [sys.executable, "-m", "agent", "tray", "--api-port", str(api)]
    cmd += [
        "--agent-arg=--no-mdns",
        "--agent-arg=--port",
        f"--agent-arg={port}",
        "--agent-arg=--device",
        "--agent-arg=CPU",
    ]
    tray = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        x, y, w, h = wait_until(lambda: _embedded(env), 90, what="the icon in the tray")
        assert 8 <= w <= 64 and 8 <= h <= 64
        # a first start (a new home) opens the first-run window beside the icon
        welcome = wait_until(
            lambda: subprocess.run(
                ["xdotool", "search", "--onlyvisible", "--name", "Set up lakeshard"],
                env=env,
                capture_output=True,
                text=True,
            ).stdout.split(),
            30,
            what="the first-run window",
        )
        assert welcome
        before = _visible_windows(env)
        subprocess.run(["xdotool", "mousemove", str(x + w // 2), str(y + h // 2), "click", "3"], env=env, check=True)
        menu = wait_until(
            lambda: [s for s in _visible_windows(env) if s not in before and s[1] > 100], 10, what="the menu"
        )
        shot = tmp_path / "tray-menu.png"
        subprocess.run(["import", "-window", "root", str(shot)], env=env, check=True, timeout=30)
        assert shot.stat().st_size > 1000 and menu[0][0] > 100
        subprocess.run(["xdotool", "key", "Escape"], env=env, check=True)

        # a second launch brings the running one forward (its chat window) and leaves
        second = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert second.returncode == 0 and "already running" in second.stdout
        chat = wait_until(
            lambda: subprocess.run(
                ["xdotool", "search", "--onlyvisible", "--name", "lakeshard chat"],
                env=env,
                capture_output=True,
                text=True,
            ).stdout.split(),
            20,
            what="the chat window",
        )
        assert chat
        agent_alive = subprocess.run(["pgrep", "-f", "--", f"--port {port}"], capture_output=True).returncode == 0
        assert agent_alive
        tray.terminate()
        assert tray.wait(20) == 0
        # it stopped the agent it had started
        wait_until(
            lambda: subprocess.run(["pgrep", "-f", "--", f"--port {port}"], capture_output=True).returncode != 0,
            20,
            what="the agent to stop",
        )
    finally:
        if tray.poll() is None:
            tray.kill()
        subprocess.run(["pkill", "-f", "--", f"--port {port}"], capture_output=True)
