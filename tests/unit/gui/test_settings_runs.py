"""Settings shows what runs (issue 40, item 4): the values the agent runs with, those that differ
from its settings file marked; names for people, not keys (in the form, the agent's errors and
"applies after the agent restarts"); the API key masked; this laptop's model override picked from
the models on offer. Pure parts table-driven, then the dialog against an in-process fake agent,
offscreen."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtWidgets import QLabel, QLineEdit

from agent.common.config import Settings, parse, to_mapping
from gui.settings import DIFFER_MARK, NO_OVERRIDE, SettingsDialog, differing, human_error, label, restart_words
from tests.support.fake_backend import FakeBackend
from tests.support.qt import run

KEY = "sk-lakeshard-0123456789abcdef"


@pytest.mark.parametrize(
    ("keys", "words"),
    [
        (["serve_model"], "Override model applies after the agent restarts"),
        (["cluster_id", "port"], "Cluster and Data port apply after the agent restarts"),
        (
            ["mdns", "static_peers", "models_dir"],
            "Discovery, Static peers and Model folder apply after the agent restarts",
        ),
        (["serve_api_port", "serve_weights"], "Chat API port and Override weights apply after the agent restarts"),
    ],
)
def test_what_waits_for_a_restart_is_said_in_words(keys: list[str], words: str) -> None:
    assert restart_words(keys) == words
    assert "_" not in words


@pytest.mark.parametrize(
    ("message", "said"),
    [
        ("throttle.temp_low_c: 95 must be below temp_high_c (90)", "Resume below: 95 must be below temp_high_c (90)"),
        ("serve.model: must be a model name or a path", "Override model: must be a model name or a path"),
        ("port: 'x' is not a port number", "Data port: 'x' is not a port number"),
        ("not valid YAML: mapping values are not allowed here", "not valid YAML: mapping values are not allowed here"),
    ],
)
def test_the_agents_errors_name_settings_for_people(message: str, said: str) -> None:
    assert human_error(message) == said


def test_every_setting_the_agent_can_name_has_a_label() -> None:
    from agent.node.daemon import LIVE_KEYS, RESTART_KEYS

    for k in (*RESTART_KEYS, *LIVE_KEYS):
        if k not in ("preferred", "exclude", "min_coordinator_memory", "throttle"):
            assert "_" not in label(k), k


@pytest.mark.parametrize(
    ("running", "file", "differ"),
    [
        (Settings(), {}, {}),
        (Settings(cluster_id="office-3f"), {}, {"cluster_id": ("office-3f", "default")}),
        (Settings(port=7710, api_port=7711), {"port": 7710}, {"api_port": (7711, 7701)}),
        (
            Settings(serve_model="smollm2-135m"),
            {"serve": {"model": "qwen2.5-coder-1.5b"}},
            {"serve.model": ("smollm2-135m", "qwen2.5-coder-1.5b")},
        ),
    ],
)
def test_settings_that_run_otherwise_than_the_file_says(
    running: Settings, file: dict[str, Any], differ: dict[str, tuple[Any, Any]]
) -> None:
    assert differing(to_mapping(running), to_mapping(parse(file or None))) == differ
    assert differing(None, {}) == {} and differing({}, None) == {}  # an older agent: nothing to compare


@pytest.fixture
def dialog(
    qloop: asyncio.AbstractEventLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[SettingsDialog, FakeBackend]]:
    monkeypatch.setenv("LAKESHARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))  # start at login: a private folder
    monkeypatch.setenv("HOME", str(tmp_path))
    from gui.settings import tray_settings_file

    tray_settings_file().write_text(json.dumps({"api_key": KEY}), encoding="utf-8")
    fake = FakeBackend()
    fake.file = {"name": "alice-laptop", "log_level": "info"}
    # the agent runs in the cluster of its certificate, on a port given on its command line
    fake.effective = to_mapping(Settings(cluster_id="office-3f", name="alice-laptop", log_level="info", port=7710))
    d = SettingsDialog(fake)  # type: ignore[arg-type]
    yield d, fake
    d.close()


def test_settings_masks_the_key_and_marks_differing_values(
    qloop: asyncio.AbstractEventLoop, dialog: tuple[SettingsDialog, FakeBackend]
) -> None:
    d, fake = dialog
    run(qloop, d.async_load())
    # what runs, not what the file says
    assert d.cluster.text() == "office-3f" and d.port.value() == 7710
    for key in ("cluster_id", "port"):
        lab, _ = d.rows[key]
        assert lab.text().endswith(DIFFER_MARK) and "the file says" in lab.toolTip()
    assert d.rows["cluster_id"][0].toolTip().startswith("The agent runs with office-3f; the file says default")
    assert d.rows["name"][0].text() == "Name"  # the same in both: unmarked
    assert d.running.isVisibleTo(d)
    assert "Cluster runs as office-3f (the file says default)" in d.running.text()
    assert "Data port runs as 7710 (the file says 7700)" in d.running.text()
    # the key: masked, in no text the dialog shows
    assert d.api_key.text() == KEY and d.api_key.echoMode() is QLineEdit.EchoMode.Password
    assert KEY not in d.api_key.displayText()
    texts = [w.text() for w in d.findChildren(QLabel)] + [w.displayText() for w in d.findChildren(QLineEdit)]
    assert not any(KEY in t for t in texts)
    d.show_key.setChecked(True)
    assert d.api_key.displayText() == KEY
    d.show_key.setChecked(False)
    assert KEY not in d.api_key.displayText()

    # Save writes what was changed, not the values shown as they run; it says what waits, in words
    d.log_level.setCurrentText("warning")
    fake.restart = ["serve_model"]
    assert run(qloop, d.async_save())
    assert fake.put[-1] == {"name": "alice-laptop", "log_level": "warning"}
    assert "Override model applies after the agent restarts" in d.message.text()
    assert "serve_model" not in d.message.text() and KEY not in d.message.text()


def test_the_served_model_is_picked_from_a_list(
    qloop: asyncio.AbstractEventLoop, dialog: tuple[SettingsDialog, FakeBackend]
) -> None:
    d, fake = dialog
    run(qloop, d.async_load())
    items = [d.model.itemText(i) for i in range(d.model.count())]
    assert items == [NO_OVERRIDE, "smollm2-135m", "qwen2.5-coder-1.5b (downloads when served)"]
    assert d.form()["serve.model"] is None  # none chosen: the cluster's model
    d.model.setCurrentIndex(2)
    assert d.form()["serve.model"] == "qwen2.5-coder-1.5b"
    assert run(qloop, d.async_save())
    assert fake.put[-1]["serve"] == {"model": "qwen2.5-coder-1.5b"}
    # loaded again: the override shows as chosen; a path can still be typed in
    assert d.model.currentData() == "qwen2.5-coder-1.5b"
    d.model.setEditText("/data/models/my-llama.gguf")
    assert d.form()["serve.model"] == "/data/models/my-llama.gguf"
