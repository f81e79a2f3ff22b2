"""Settings' "Model" tab against a real agent (issue 37): the cluster's model is picked from the
agent's registry and store, saved through the agent (which refuses an unknown name with a line
the dialog shows), and this laptop's own serve.model override is named as such."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from coordinator.lab.local_cluster import LocalCluster
from gui.client import Client
from tests.support.qt import run

pytestmark = pytest.mark.timeout(300)


def _get(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return dict(json.loads(r.read()))


def _items(box: Any) -> list[tuple[str, Any]]:
    return [(box.itemText(i), box.itemData(i)) for i in range(box.count())]


# the agent never coordinates here (no laptop has 4 TB): nothing is exported or served
NOT_ELECTED = "election:\n  min_coordinator_memory_gb: 4096\n"


def _store(smollm2: Any) -> dict[str, str]:
    """The agents' model store: the user's, where the test model is (the tray's home is a temporary one)."""
    return {"LAKESHARD_MODELS_DIR": str(smollm2.dir.parent)}


def test_the_model_tab_sets_the_clusters_model(
    qloop: asyncio.AbstractEventLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2: Any
) -> None:
    from gui.settings import SettingsDialog

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("LAKESHARD_HOME", str(tmp_path / "tray"))
    with LocalCluster(1, elect=[], names=["alice-laptop"], env=_store(smollm2), config=NOT_ELECTED) as c:
        api = c.api_ports[0]
        client = Client(f"http://127.0.0.1:{api}")
        d = SettingsDialog(client)
        run(qloop, d.async_load())
        p = d.cluster_model
        assert p.isEnabled() and d.tabs.tabText(d.tabs.indexOf(p)) == "Model"
        models = _items(p.model)
        assert models[0] == ("choose a model…", None)  # nothing chosen yet: saving chooses nothing
        assert ("smollm2-135m", "smollm2-135m") in models  # pulled (the test model)
        assert ("qwen2.5-coder-1.5b (downloads when served)", "qwen2.5-coder-1.5b") in models
        assert "no model chosen for the cluster yet" in p.current.text() and p.override.text() == ""
        assert not p.changed()

        # a name the agent does not know (the store changed since the list was read): its error, shown
        p.model.addItem("gone-model", "gone-model")
        p.model.setCurrentIndex(p.model.count() - 1)
        assert run(qloop, d.async_save()) is False
        assert d.message.text().startswith("not saved: the cluster's model: unknown model 'gone-model'")
        assert _get(api, "/v1/cluster/model")["cluster"] is None

        # picked and saved: the agent holds it, and says it serves it when elected
        p.model.setCurrentIndex(p.model.findData("smollm2-135m"))
        p.weights.setCurrentIndex(p.weights.findData("int8"))
        p.draft.setCurrentIndex(p.draft.findData("lookup"))
        assert run(qloop, d.async_save()) is True
        st = _get(api, "/v1/cluster/model")
        assert (st["cluster"]["model"], st["cluster"]["weights"], st["cluster"]["draft"]) == (
            "smollm2-135m",
            "int8",
            "lookup",
        )
        assert st["cluster"]["label"] == "cluster setting v1 by alice-laptop"
        assert st["effective"]["model"] == "smollm2-135m" and st["effective"]["source"] == "cluster"
        assert "cluster setting v1 by alice-laptop: the cluster serves smollm2-135m (int8)" in d.message.text()
        assert p.current.text() == "now: smollm2-135m (cluster setting v1 by alice-laptop)"
        assert not p.changed()  # reloaded: saving again sets nothing
        assert run(qloop, d.async_save()) is True and _get(api, "/v1/cluster/model")["cluster"]["version"] == 1

        # the Agent tab's override: a name that exists nowhere is refused too (nothing written)
        d.tabs.setCurrentIndex(0)
        d.model.setEditText("no-such-model")  # (a name typed in, not one of the list)
        assert run(qloop, d.async_save()) is False
        assert d.message.text().startswith("not saved: Override model: unknown model 'no-such-model': use one of"), (
            d.message.text()
        )
        assert "serve" not in _get(api, "/v1/settings")["settings"]
        run(qloop, client.close())


def test_the_model_tab_names_this_laptops_override(qloop: asyncio.AbstractEventLoop, smollm2: Any) -> None:
    from gui.settings import SettingsDialog

    config = NOT_ELECTED + "serve:\n  model: smollm2-135m\n  weights: fp16\n"
    with LocalCluster(1, elect=[], config=config, env=_store(smollm2)) as c:
        api = c.api_ports[0]
        client = Client(f"http://127.0.0.1:{api}")
        d = SettingsDialog(client)
        run(qloop, d.async_load())
        p = d.cluster_model
        assert p.override.text().startswith("this laptop overrides it with smollm2-135m (serve.model in config.yaml)")
        assert d.form()["serve.model"] == "smollm2-135m"  # the Agent tab's override, picked in its list
        p.model.setCurrentIndex(p.model.findData("smollm2-135m"))
        assert run(qloop, d.async_save()) is True
        assert "this laptop overrides it with smollm2-135m" in d.message.text()
        eff = _get(api, "/v1/cluster/model")["effective"]
        assert (eff["model"], eff["weights"], eff["source"]) == ("smollm2-135m", "fp16", "override")
        assert eff["why"] == "this laptop's override (serve.model in config.yaml)"
        node = _get(api, "/v1/node")
        assert node["model"]["override"] is True
        run(qloop, client.close())
