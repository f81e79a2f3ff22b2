"""Every module imports on its own, in a fresh interpreter (no module works only because another
was imported first)."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agent", "coordinator", "gui")


def _modules() -> list[str]:
    out = []
    for top in PACKAGES:
        out.append(top)
        for m in pkgutil.walk_packages([str(ROOT / top)], prefix=f"{top}."):
            if not m.name.endswith(".__main__"):  # (runs the CLI)
                out.append(m.name)
    return sorted(out)


def test_there_are_modules_to_import() -> None:
    mods = _modules()
    assert "agent.cli.main" in mods and "coordinator.service.role" in mods and "gui.tray" in mods
    assert len(mods) > 100


@pytest.mark.parametrize("top", PACKAGES)
def test_every_module_imports_in_a_fresh_interpreter(top: str) -> None:
    mods = [m for m in _modules() if m == top or m.startswith(top + ".")]
    # a fresh interpreter for each module would take minutes (torch, OpenVINO and Qt each time);
    # one fresh interpreter per package, importing its modules in turn with this project's modules
    # dropped from sys.modules before each, checks the same: nothing imports only because
    # another module came first
    code = (
        "import importlib, sys\n"
        f"mods = {mods!r}\n"
        "bad = []\n"
        "for m in mods:\n"
        "    for k in [k for k in sys.modules if k.split('.')[0] in ('agent', 'coordinator', 'gui')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{m}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "QT_QPA_PLATFORM": "offscreen"},
    )
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
