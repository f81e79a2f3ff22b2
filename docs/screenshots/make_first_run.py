"""The first-run window's screenshot for the README, offscreen, against the tests' fake agent.

    .venv/bin/python docs/screenshots/make_first_run.py [--out docs/screenshots]

The window as a new laptop shows it: in no cluster yet, the agent's default throttle, and
"working hours" picked. Needs no X server, no agent and no model (the other screenshots need a
real cluster: make_screenshots.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    home = tempfile.TemporaryDirectory(prefix="lakeshard-shots-")
    # the tray's settings and start at login in a throwaway folder (not this user's)
    os.environ.update(
        QT_QPA_PLATFORM="offscreen", LAKESHARD_HOME=home.name, XDG_CONFIG_HOME=home.name, XDG_CONFIG_DIRS=home.name
    )
    import qasync
    from PySide6.QtWidgets import QApplication

    from gui.first_run import FirstRunWindow
    from tests.support.fake_backend import FakeBackend

    app = QApplication(sys.argv[:1])
    app.setApplicationName("lakeshard")
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    fake = FakeBackend()
    fake.node_json = {"node": "me", "state": "no_cluster", "role": "no_cluster"}
    fake.file = {"name": "alice-laptop"}
    w = FirstRunWindow(fake)  # type: ignore[arg-type]
    w.show()
    with loop:
        loop.run_until_complete(w.async_load())
    w.work.setChecked(True)
    w.autostart.setChecked(True)
    app.processEvents()
    shot = args.out / "first_run.png"
    w.grab().save(str(shot))
    print(f"wrote {shot}")
    home.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
