"""Screenshots of the tray app for the README, from a real local cluster.

    .venv/bin/python docs/screenshots/make_screenshots.py [--out docs/screenshots]

Starts an X server (Xvfb) with an XEmbed tray (trayer), three agent processes that elect a
coordinator and serve SmolLM2, and the tray app in this process; then saves the tray's menu
opened from its icon (xdotool), the chat window mid-answer, and the node map. Needs Xvfb,
trayer, xdotool and ImageMagick's ``import`` (Debian: xvfb trayer xdotool imagemagick).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))


def _x(env: dict[str, str], *cmd: str) -> str:
    return subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=30).stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--display", default=":77")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    xvfb = subprocess.Popen(["Xvfb", args.display, "-screen", "0", "1400x900x24", "-nolisten", "tcp"])
    os.environ.update(DISPLAY=args.display, QT_QPA_PLATFORM="xcb")
    env = dict(os.environ)
    time.sleep(1.0)
    tray_host = subprocess.Popen(
        ["trayer", "--edge", "top", "--align", "right", "--widthtype", "request", "--height", "28"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    from coordinator.lab.local_cluster import LocalCluster

    print("screenshots: starting three agents", flush=True)
    names = ["alice-laptop", "bob-laptop", "carol-laptop"]
    cluster = LocalCluster(3, elect=["--serve-model", "smollm2-135m", "--serve-weights", "int8"], names=names).start()
    home = tempfile.TemporaryDirectory(prefix="lakeshard-shots-")
    os.environ["LAKESHARD_HOME"] = home.name
    try:
        return asyncio_main(cluster, args.out, env)
    finally:
        cluster.stop()
        tray_host.terminate()
        xvfb.terminate()
        home.cleanup()


def asyncio_main(cluster: object, out: Path, env: dict[str, str]) -> int:
    import qasync
    from PySide6.QtWidgets import QApplication

    from gui.chat.store import Store
    from gui.chat.window import ChatWindow
    from gui.client import Client
    from gui.tray import TrayApp

    app = QApplication(sys.argv[:1])
    app.setApplicationName("lakeshard")
    app.setQuitOnLastWindowClosed(False)
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    api = f"http://127.0.0.1:{cluster.api_ports[0]}"  # type: ignore[attr-defined]

    async def until(pred, timeout: float = 600.0) -> None:  # type: ignore[no-untyped-def]
        end = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > end:
                raise TimeoutError("screenshots: timed out")
            await asyncio.sleep(0.1)
            if int(time.monotonic() * 10) % 300 == 0:
                print("  still waiting:", tray_state(), flush=True)

    box: dict[str, object] = {}

    def tray_state() -> object:
        t = box.get("tray")
        return None if t is None else (t.node is not None, t.error, t.view and (t.view.service, len(t.view.nodes)))  # type: ignore[attr-defined]

    def say(what: str) -> None:
        print(f"screenshots: {what}", flush=True)

    async def shots() -> None:
        say("waiting for the cluster to serve")
        client = Client(api)
        tray = TrayApp(client, poll_s=0.5)
        box["tray"] = tray
        tray.start()
        await until(lambda: tray.view is not None and tray.view.service == "serving" and len(tray.view.nodes) == 3)
        await until(lambda: tray.icon.isVisible(), 30)
        await asyncio.sleep(2.0)
        say("the tray menu")
        # the tray menu, opened from the icon in the tray
        tree = _x(env, "xwininfo", "-root", "-tree")
        m = re.search(
            r'"lakeshard": \([^)]*\)\s+(\d+)x(\d+)\+-?\d+\+-?\d+\s+\+(-?\d+)\+(-?\d+)', tree[tree.find('"panel"') :]
        )
        assert m is not None, "the icon is not in the tray"
        w, h, x, y = map(int, m.groups())
        subprocess.run(["xdotool", "mousemove", str(x + w // 2), str(y + h // 2), "click", "3"], env=env, check=True)
        await asyncio.sleep(1.0)
        shot = out / "tray-menu.png"
        subprocess.run(
            ["import", "-window", "root", "-crop", f"420x300+{max(0, x - 380)}+0", str(shot)], env=env, check=True
        )
        subprocess.run(["xdotool", "key", "Escape"], env=env, check=True)
        say("the chat window")
        # the chat window, mid-answer
        chat = ChatWindow(client, Store(Path(os.environ["LAKESHARD_HOME"]) / "shots.sqlite3"), names=tray.names)
        chat.resize(1000, 640)
        chat.show()
        await until(lambda: chat.reachable and chat.model.count() > 0, 120)
        chat.input.setPlainText("Write a short Python function that checks whether a number is prime, and explain it.")
        chat.send()
        await until(lambda: chat.streaming is None, 120)
        say("the node map")
        tray.show_map()
        tray.map.resize(1180, 720)
        tray.map.show_node(tray.view.ring[-1] if tray.view and tray.view.ring else "")
        chat.input.setPlainText("Now make it faster for large numbers.")
        chat.send()
        await until(lambda: chat.live is not None and len(chat.live["text"]) > 160, 120)
        chat.redraw()
        chat.grab().save(str(out / "chat.png"))
        await asyncio.sleep(1.2)  # the stages' tok/s, measured over a second
        tray.map.grab().save(str(out / "node-map.png"))
        await until(lambda: chat.streaming is None, 120)
        await chat.async_stop()
        await tray.async_stop()

    with loop:
        loop.run_until_complete(shots())
    print(f"wrote {', '.join(p.name for p in sorted(out.glob('*.png')))} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
