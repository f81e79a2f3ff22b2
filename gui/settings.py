"""Settings: the agent's ``config.yaml`` (checked by the agent's own parser when saved), start
at login, and where the chat and node map find the coordinator.

The agent's settings go through its local API (``PUT /v1/settings``), so a bad value is the
agent's own one-line error, shown here, and nothing is written. The model the whole cluster
serves has a tab of its own (:mod:`gui.cluster_model`); the Agent tab's model is this laptop's
override of it. The tray's own settings (coordinator URL and key) live in ``tray.json`` next
to ``config.yaml``; the URL is checked as it is typed (Save waits until it is a usable http(s)
address) and, once saved, the chat and the node map use it at once.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QSpinBox,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from gui import autostart
from gui.client import ApiError, Client, Unreachable, url_problem
from gui.cluster_model import ClusterModelPicker

WEIGHTS = ("", "fp32", "fp16", "int8", "int4")
MODES = ("pause", "limit", "run")
LOG_LEVELS = ("debug", "info", "warning", "error")


def tray_settings_file() -> Path:
    import platformdirs

    h = os.environ.get("LAKESHARD_HOME")
    d = Path(h).expanduser() / "config" if h else Path(platformdirs.user_config_dir("lakeshard"))
    d.mkdir(parents=True, exist_ok=True)
    return d / "tray.json"


def load_tray_settings() -> dict[str, Any]:
    try:
        d = json.loads(tray_settings_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def save_tray_settings(d: dict[str, Any]) -> None:
    tray_settings_file().write_text(json.dumps(d, indent=2), encoding="utf-8")


def _unless(v: Any, default: Any) -> Any:
    return None if v == default else v


def merge(raw: dict[str, Any], form: dict[str, Any]) -> dict[str, Any]:
    """The settings mapping with the form's values in place (pure; empty values remove keys)."""
    out: dict[str, Any] = json.loads(json.dumps(raw))  # a deep copy

    def put(path: str, value: Any) -> None:
        *parents, key = path.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        if value in (None, "", []):
            d.pop(key, None)
        else:
            d[key] = value

    for k, v in form.items():
        put(k, v)
    for section in ("discovery", "election", "serve", "throttle"):
        if out.get(section) == {}:
            out.pop(section)
    return out


class SettingsDialog(QDialog):
    def __init__(self, client: Client, restart_agent: Callable[[], bool] = lambda: False) -> None:
        super().__init__()
        self.client = client
        self.restart_agent = restart_agent
        self.raw: dict[str, Any] = {}
        self.setWindowTitle("lakeshard settings")
        self.resize(560, 520)
        tabs = QTabWidget()
        f = QWidget()
        form = QFormLayout(f)
        self.cluster = QLineEdit()
        self.name = QLineEdit()
        self.name.setPlaceholderText("what the node map calls this laptop (default: its host name)")
        self.port = QSpinBox()
        self.port.setRange(0, 65535)
        self.api_port = QSpinBox()
        self.api_port.setRange(0, 65535)
        self.mdns = QCheckBox("find peers by multicast DNS")
        self.peers = QLineEdit()
        self.peers.setPlaceholderText("host:port, host:port (where multicast is blocked)")
        self.model = QLineEdit()  # serve.model: this laptop's override of the cluster's model
        self.model.setPlaceholderText("blank: the cluster's model (Model tab); a name here overrides it on this laptop")
        self.weights = QComboBox()
        self.weights.addItems(WEIGHTS)
        self.serve_port = QSpinBox()
        self.serve_port.setRange(0, 65535)
        self.models_dir = QLineEdit()
        self.models_dir.setPlaceholderText("default: the cache folder")
        self.log_level = QComboBox()
        self.log_level.addItems(LOG_LEVELS)
        self.autostart = QCheckBox("start lakeshard when I log in")
        for label, w in (
            ("Cluster", self.cluster),
            ("Name", self.name),
            ("Data port", self.port),
            ("Status API port", self.api_port),
            ("Discovery", self.mdns),
            ("Static peers", self.peers),
            ("Override model", self.model),
            ("Override weights", self.weights),
            ("Chat API port", self.serve_port),
            ("Model folder", self.models_dir),
            ("Log level", self.log_level),
            ("At login", self.autostart),
        ):
            form.addRow(label, w)
        tabs.addTab(f, "Agent")
        self.cluster_model = ClusterModelPicker(client)  # the cluster's model: its own tab
        tabs.addTab(self.cluster_model, "Model")
        y = QWidget()
        yf = QFormLayout(y)
        self.idle_minutes = QDoubleSpinBox()
        self.idle_minutes.setRange(0, 24 * 60)
        self.idle_minutes.setSuffix(" min")
        self.while_in_use = QComboBox()
        self.while_in_use.addItems(MODES)
        self.temp_high = QSpinBox()
        self.temp_high.setRange(30, 130)
        self.temp_high.setSuffix(" °C")
        self.temp_low = QSpinBox()
        self.temp_low.setRange(20, 130)
        self.temp_low.setSuffix(" °C")
        self.on_battery = QComboBox()
        self.on_battery.addItems(MODES)
        self.battery_floor = QSpinBox()
        self.battery_floor.setRange(0, 100)
        self.battery_floor.setSuffix(" %")
        self.hours = QLineEdit()
        self.hours.setPlaceholderText("any time; or e.g. 08:00-19:00")
        self.throttle_on = QCheckBox("step back when this laptop's user needs it")
        rows: tuple[tuple[str, QWidget], ...] = (
            ("", self.throttle_on),
            ("Contribute after", self.idle_minutes),
            ("While I use it", self.while_in_use),
            ("Pause at", self.temp_high),
            ("Resume below", self.temp_low),
            ("On battery", self.on_battery),
            ("Battery floor", self.battery_floor),
            ("Hours", self.hours),
        )
        for label, widget in rows:
            yf.addRow(label, widget)
        tabs.addTab(y, "When I use it")
        c = QWidget()
        cf = QFormLayout(c)
        self.coordinator_url = QLineEdit()
        self.coordinator_url.setPlaceholderText("blank: through this laptop's agent (recommended)")
        self.url_error = QLabel("")
        self.url_error.setWordWrap(True)
        self.url_error.setStyleSheet("color:#b91c1c")
        self.url_error.setVisible(False)
        self.api_key = QLineEdit()
        self.api_key.setEchoMode(QLineEdit.EchoMode.Password)
        cf.addRow("Coordinator API", self.coordinator_url)
        cf.addRow("", self.url_error)
        cf.addRow("API key", self.api_key)
        tabs.addTab(c, "Chat")
        a = QWidget()
        av = QVBoxLayout(a)
        av.addWidget(QLabel("config.yaml, checked by the agent when saved:"))
        self.text = QPlainTextEdit()
        av.addWidget(self.text)
        tabs.addTab(a, "Advanced")
        self.advanced_tab = tabs.count() - 1
        self.tabs = tabs
        self.message = QLabel("")
        self.message.setWordWrap(True)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Close)
        buttons.accepted.connect(self.save)
        buttons.rejected.connect(self.reject)
        self.save_btn = buttons.button(QDialogButtonBox.StandardButton.Save)
        self.coordinator_url.textChanged.connect(self._check_url)
        lay = QVBoxLayout(self)
        lay.addWidget(tabs)
        lay.addWidget(self.message)
        lay.addWidget(buttons)
        self._task: asyncio.Task[Any] | None = None
        self.saved = asyncio.Event()

    def url_problem(self) -> str | None:
        """What is wrong with the coordinator URL in the form, in words (None: nothing)."""
        why = url_problem(self.coordinator_url.text())
        return f"The coordinator URL is not valid: {why}." if why else None

    def _check_url(self) -> None:
        """Say what is wrong under the field and in the message line (seen from every tab,
        so a greyed Save always has its reason in view)."""
        why = self.url_problem()
        self.url_error.setText(why or "")
        self.url_error.setVisible(why is not None)
        self.save_btn.setEnabled(why is None)
        if why:
            self.message.setText(f"{why} Save waits until it is corrected (Chat tab).")
        elif "The coordinator URL is not valid" in self.message.text():
            self.message.setText("")

    # -- loading ---------------------------------------------------------------------------------
    def load(self) -> None:
        self._task = asyncio.ensure_future(self.async_load())

    async def async_load(self) -> None:
        try:
            cur = await self.client.settings()
        except (Unreachable, ApiError) as e:
            self.message.setText(f"the agent does not answer, so its settings cannot be read: {e}")
            return
        self.raw = cur.get("settings") or {}
        self.fill(self.raw, cur.get("text", ""), cur.get("file", ""))
        await self.cluster_model.async_load()

    def fill(self, raw: dict[str, Any], text: str, file: str) -> None:
        disc, serve = raw.get("discovery") or {}, raw.get("serve") or {}
        self.cluster.setText(str(raw.get("cluster_id", "default")))
        self.name.setText(str(raw.get("name") or ""))
        self.port.setValue(int(raw.get("port", 7700)))
        self.api_port.setValue(int(raw.get("api_port", 7701)))
        self.mdns.setChecked(bool(disc.get("mdns", True)))
        self.peers.setText(", ".join(disc.get("static_peers") or []))
        self.model.setText(str(serve.get("model") or ""))
        self.weights.setCurrentText(str(serve.get("weights") or ""))
        self.serve_port.setValue(int(serve.get("api_port", 8000)))
        self.models_dir.setText(str(raw.get("models_dir") or ""))
        self.log_level.setCurrentText(str(raw.get("log_level", "debug")))
        self.autostart.setChecked(autostart.is_enabled())
        th = raw.get("throttle") or {}
        self.throttle_on.setChecked(bool(th.get("enabled", True)))
        self.idle_minutes.setValue(float(th.get("idle_minutes", 2)))
        self.while_in_use.setCurrentText(str(th.get("while_in_use", "pause")))
        self.temp_high.setValue(int(th.get("temp_high_c", 90)))
        self.temp_low.setValue(int(th.get("temp_low_c", 80)))
        self.on_battery.setCurrentText(str(th.get("on_battery", "pause")))
        self.battery_floor.setValue(int(th.get("battery_floor_pct", 30)))
        self.hours.setText(str(th.get("hours") or ""))
        self.text.setPlainText(text)
        tray = load_tray_settings()
        self.coordinator_url.setText(tray.get("coordinator_url") or "")
        self.api_key.setText(tray.get("api_key") or "")
        self.message.setText(f"settings file: {file}")
        self._check_url()  # a bad URL already in tray.json is pointed out at once

    def form(self) -> dict[str, Any]:
        peers = [p.strip() for p in self.peers.text().split(",") if p.strip()]
        # defaults are left out, so that the file says only what was chosen
        cluster = self.cluster.text().strip()
        return {
            "cluster_id": cluster if cluster not in ("", "default") else None,
            "name": self.name.text().strip(),
            "port": self.port.value() if self.port.value() != 7700 else None,
            "api_port": self.api_port.value() if self.api_port.value() != 7701 else None,
            "discovery.mdns": None if self.mdns.isChecked() else False,
            "discovery.static_peers": peers,
            "serve.model": self.model.text().strip(),
            "serve.weights": self.weights.currentText(),
            "serve.api_port": self.serve_port.value() if self.serve_port.value() != 8000 else None,
            "models_dir": self.models_dir.text().strip(),
            "log_level": self.log_level.currentText() if self.log_level.currentText() != "debug" else None,
            # the throttle: what differs from the agent's defaults
            "throttle.enabled": None if self.throttle_on.isChecked() else False,
            "throttle.idle_minutes": _unless(self.idle_minutes.value(), 2.0),
            "throttle.while_in_use": _unless(self.while_in_use.currentText(), "pause"),
            "throttle.temp_high_c": _unless(self.temp_high.value(), 90),
            "throttle.temp_low_c": _unless(self.temp_low.value(), 80),
            "throttle.on_battery": _unless(self.on_battery.currentText(), "pause"),
            "throttle.battery_floor_pct": _unless(self.battery_floor.value(), 30),
            "throttle.hours": self.hours.text().strip(),
        }

    # -- saving ----------------------------------------------------------------------------------
    def save(self) -> None:
        self._task = asyncio.ensure_future(self.async_save())

    async def async_save(self) -> bool:
        self.saved.clear()
        why = self.url_problem()
        if why:  # nothing is saved while it is wrong (the agent's settings neither)
            self.message.setText(f"not saved: {why}")
            return False
        advanced = self.tabs.currentIndex() == self.advanced_tab
        try:  # the cluster's model first: a name the agent refuses stops the save here
            model_msg = await self.cluster_model.async_save()
        except (ApiError, Unreachable) as e:
            self.message.setText(f"not saved: the cluster's model: {e}")
            return False
        try:
            if advanced:
                r = await self.client.put_settings(text=self.text.toPlainText())
            else:
                r = await self.client.put_settings(merge(self.raw, self.form()))
        except ApiError as e:
            self.message.setText(f"not saved: {e}")
            return False
        except Unreachable as e:
            self.message.setText(f"not saved: the agent does not answer ({e})")
            return False
        where = autostart.set_enabled(self.autostart.isChecked())
        tray = load_tray_settings()
        tray["coordinator_url"] = self.coordinator_url.text().strip() or None
        tray["api_key"] = self.api_key.text() or None
        save_tray_settings(tray)
        self.client.point_at(tray["coordinator_url"], tray["api_key"])  # the chat follows at once
        msg = f"saved to {r.get('file')}; start at login: {'on' if self.autostart.isChecked() else 'off'} ({where})"
        if r.get("restart"):
            msg += f". {', '.join(r['restart'])} apply after the agent restarts"
            msg += "; restarting it now." if self.restart_agent() else "; restart it to apply them."
        await self.async_load()
        self.message.setText(f"{model_msg}. {msg}" if model_msg else msg)
        self.saved.set()
        return True
