"""Settings: the agent's ``config.yaml`` (checked by the agent's own parser when saved), start
at login, and where the chat and node map find the coordinator.

It shows what runs: the values the agent runs with (``effective`` in its ``GET /v1/settings``),
each one that differs from what the file says marked (its label, with the two values in its
tooltip and in a line under the tabs: a cluster from the laptop's certificate, a port given on the
agent's command line, a change that waits for a restart). Save writes only what was changed in
the form. Settings have names for people ("Override model", not ``serve_model``), in the form, in
the agent's errors and in "applies after the agent restarts"; the API key is masked (Show
reveals it while ticked); this laptop's model override is picked from the models on offer (or a
path typed in).

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
    QHBoxLayout,
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
# what the user's input (and a battery) makes the laptop do: the setting, and its words
MODES = (("pause", "pause"), ("limit", "go on, limited"), ("run", "go on fully"))
LOG_LEVELS = ("debug", "info", "warning", "error")
NO_OVERRIDE = "none: the cluster's model (Model tab)"
DIFFER_MARK = "●"  # beside a setting that runs otherwise than the file says
DIFFER_COLOUR = "#b45309"
# the settings' names as people read them: by their path in config.yaml, and by the agent's own
# names for those that apply after a restart (``restart`` in its answer to a save)
LABELS = {
    "cluster_id": "Cluster",
    "name": "Name",
    "port": "Data port",
    "api_port": "Status API port",
    "discovery.mdns": "Discovery",
    "discovery.static_peers": "Static peers",
    "serve.model": "Override model",
    "serve.weights": "Override weights",
    "serve.api_port": "Chat API port",
    "models_dir": "Model folder",
    "log_level": "Log level",
    "throttle.enabled": "Step back for the user",
    "throttle.idle_minutes": "Contribute after",
    "throttle.while_in_use": "While I use it",
    "throttle.temp_high_c": "Pause at",
    "throttle.temp_low_c": "Resume below",
    "throttle.on_battery": "On battery",
    "throttle.battery_floor_pct": "Battery floor",
    "throttle.hours": "Hours",
    "interface": "Network interface",
    "insecure": "Plaintext links (insecure)",
    "serve.ring_port": "Ring port",
    "serve.streams": "Streams",
    "serve.min_nodes": "Fewest nodes",
    "serve.api_rate": "Chat API rate limit",
    "serve.api_concurrency": "Chat API requests in flight",
    "serve.attention": "Attention",
    "election.preferred": "Preferred coordinators",
    "election.exclude": "Never coordinate",
    "election.min_coordinator_memory_gb": "Memory a coordinator needs",
    "throttle.days": "Days",
    "throttle.cpu_high_pct": "Limit when other programs' CPU use reaches",
    "throttle.cpu_low_pct": "Fully again when other programs' CPU use falls to",
    "throttle.gpu_high_pct": "Limit when other programs' GPU use reaches",
    "throttle.gpu_low_pct": "Fully again when other programs' GPU use falls to",
    "throttle.limited_share": "Share offered while limited",
    "throttle.min_dwell_s": "Least time in a state",
}
RESTART_LABELS = {
    "mdns": LABELS["discovery.mdns"],
    "static_peers": LABELS["discovery.static_peers"],
    **{k.replace(".", "_"): v for k, v in LABELS.items() if k.startswith("serve.")},
    **{k: v for k, v in LABELS.items() if "." not in k},
}


def label(key: str) -> str:
    """A setting's name for people, from its path in config.yaml or the agent's name for it."""
    return LABELS.get(key) or RESTART_LABELS.get(key) or key.rsplit(".", 1)[-1].replace("_", " ")


def restart_words(keys: list[str]) -> str:
    """'Override model and Data port apply after the agent restarts' (pure)."""
    names = [label(k) for k in keys]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"{listed} appl{'ies' if len(names) == 1 else 'y'} after the agent restarts"


def human_error(message: str) -> str:
    """The agent's one-line error with the setting it names said for people
    ('throttle.temp_low_c: ...' -> 'Resume below: ...')."""
    key, sep, rest = message.partition(":")
    return f"{LABELS[key]}:{rest}" if sep and key in LABELS else message


def flatten(d: dict[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    """{"serve": {"model": "m"}} -> {"serve.model": "m"} (pure)."""
    out: dict[str, Any] = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differing(effective: dict[str, Any] | None, from_file: dict[str, Any] | None) -> dict[str, tuple[Any, Any]]:
    """The settings the agent runs with that its file does not give: path -> (running, file)
    (pure; either side unknown: none)."""
    if effective is None or from_file is None:
        return {}
    run, file = flatten(effective), flatten(from_file)
    return {k: (run.get(k), file.get(k)) for k in sorted(set(run) | set(file)) if run.get(k) != file.get(k)}


def shown(v: Any) -> str:
    """A setting's value in words ('not set' for none)."""
    if v is None or v == "" or v == []:
        return "not set"
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, list):
        return ", ".join(map(str, v))
    return str(v)


def _combo_value(box: QComboBox) -> Any:
    """An editable combo box's value: the chosen item's data, or the text typed in it."""
    i = box.currentIndex()
    if i >= 0 and box.currentText() == box.itemText(i):
        return box.itemData(i)
    return box.currentText().strip() or None


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
        self.filled: dict[str, Any] = {}  # the form as it was filled: only what the user changes is saved
        self.differ: dict[str, tuple[Any, Any]] = {}  # the settings that run otherwise than the file says
        self.rows: dict[str, tuple[QLabel, QWidget]] = {}  # a setting's path -> its label and field
        self.setWindowTitle("lakeshard settings")
        self.resize(600, 540)
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
        self.model = QComboBox()  # serve.model: this laptop's override of the cluster's model
        self.model.setEditable(True)  # a model of the list, or a path typed in
        self.model.setToolTip("The model this laptop serves when it is elected, instead of the cluster's")
        self._fill_models([], None)
        self.weights = QComboBox()
        self.weights.addItems(WEIGHTS)
        self.serve_port = QSpinBox()
        self.serve_port.setRange(0, 65535)
        self.models_dir = QLineEdit()
        self.models_dir.setPlaceholderText("default: the cache folder")
        self.log_level = QComboBox()
        self.log_level.addItems(LOG_LEVELS)
        self.autostart = QCheckBox("start lakeshard when I log in")
        for key, w in (
            ("cluster_id", self.cluster),
            ("name", self.name),
            ("port", self.port),
            ("api_port", self.api_port),
            ("discovery.mdns", self.mdns),
            ("discovery.static_peers", self.peers),
            ("serve.model", self.model),
            ("serve.weights", self.weights),
            ("serve.api_port", self.serve_port),
            ("models_dir", self.models_dir),
            ("log_level", self.log_level),
        ):
            self._row(form, key, w)
        form.addRow("At login", self.autostart)
        tabs.addTab(f, "Agent")
        self.cluster_model = ClusterModelPicker(client)  # the cluster's model: its own tab
        tabs.addTab(self.cluster_model, "Model")
        y = QWidget()
        yf = QFormLayout(y)
        self.idle_minutes = QDoubleSpinBox()
        self.idle_minutes.setRange(0, 24 * 60)
        self.idle_minutes.setSuffix(" min")
        self.while_in_use = _modes()
        self.temp_high = QSpinBox()
        self.temp_high.setRange(30, 130)
        self.temp_high.setSuffix(" °C")
        self.temp_low = QSpinBox()
        self.temp_low.setRange(20, 130)
        self.temp_low.setSuffix(" °C")
        self.on_battery = _modes()
        self.battery_floor = QSpinBox()
        self.battery_floor.setRange(0, 100)
        self.battery_floor.setSuffix(" %")
        self.hours = QLineEdit()
        self.hours.setPlaceholderText("any time; or e.g. 08:00-19:00")
        self.throttle_on = QCheckBox("step back when this laptop's user needs it")
        for key, widget in (
            ("throttle.enabled", self.throttle_on),
            ("throttle.idle_minutes", self.idle_minutes),
            ("throttle.while_in_use", self.while_in_use),
            ("throttle.temp_high_c", self.temp_high),
            ("throttle.temp_low_c", self.temp_low),
            ("throttle.on_battery", self.on_battery),
            ("throttle.battery_floor_pct", self.battery_floor),
            ("throttle.hours", self.hours),
        ):
            self._row(yf, key, widget)
        tabs.addTab(y, "When I use it")
        c = QWidget()
        cf = QFormLayout(c)
        self.coordinator_url = QLineEdit()
        self.coordinator_url.setPlaceholderText("blank: through this laptop's agent (recommended)")
        self.url_error = QLabel("")
        self.url_error.setWordWrap(True)
        self.url_error.setStyleSheet("color:#b91c1c")
        self.url_error.setVisible(False)
        self.api_key = QLineEdit()  # a secret: masked, shown only while "Show" is ticked
        self.api_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.api_key.setPlaceholderText("none")
        self.show_key = QCheckBox("Show")
        self.show_key.toggled.connect(self._show_key)
        key_row = QHBoxLayout()
        key_row.addWidget(self.api_key, 1)
        key_row.addWidget(self.show_key)
        cf.addRow("Coordinator API", self.coordinator_url)
        cf.addRow("", self.url_error)
        cf.addRow("API key", key_row)
        tabs.addTab(c, "Chat")
        a = QWidget()
        av = QVBoxLayout(a)
        av.addWidget(QLabel("config.yaml, checked by the agent when saved:"))
        self.text = QPlainTextEdit()
        av.addWidget(self.text)
        tabs.addTab(a, "Advanced")
        self.advanced_tab = tabs.count() - 1
        self.tabs = tabs
        self.running = QLabel("")  # the settings that run otherwise than the file says, and why
        self.running.setWordWrap(True)
        self.running.setStyleSheet(f"color:{DIFFER_COLOUR}")
        self.running.setVisible(False)
        self.message = QLabel("")
        self.message.setWordWrap(True)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Close)
        buttons.accepted.connect(self.save)
        buttons.rejected.connect(self.reject)
        self.save_btn = buttons.button(QDialogButtonBox.StandardButton.Save)
        self.coordinator_url.textChanged.connect(self._check_url)
        lay = QVBoxLayout(self)
        lay.addWidget(tabs)
        lay.addWidget(self.running)
        lay.addWidget(self.message)
        lay.addWidget(buttons)
        self._task: asyncio.Task[Any] | None = None
        self.saved = asyncio.Event()

    def _row(self, form: QFormLayout, key: str, widget: QWidget) -> None:
        lab = QLabel(LABELS[key])
        form.addRow(lab, widget)
        self.rows[key] = (lab, widget)

    def _show_key(self, on: bool) -> None:
        self.api_key.setEchoMode(QLineEdit.EchoMode.Normal if on else QLineEdit.EchoMode.Password)

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
        await self.cluster_model.async_load()
        models = (self.cluster_model.loaded or {}).get("models") or []
        self._fill_models([m for m in models if isinstance(m, dict) and m.get("name")], None)
        self.fill(self.raw, cur.get("text", ""), cur.get("file", ""), cur.get("effective"), cur.get("from_file"))

    def _fill_models(self, models: list[dict[str, Any]], current: str | None) -> None:
        """The override's choices: none (the cluster's model), then the models on offer."""
        self.model.clear()
        self.model.addItem(NO_OVERRIDE, None)
        for m in models:
            self.model.addItem(str(m["name"]) + ("" if m.get("pulled") else " (downloads when served)"), m["name"])
        self._pick_model(current)

    def _pick_model(self, name: str | None) -> None:
        i = self.model.findData(name)
        if i < 0 and name:  # a path, or a model this laptop's list lacks
            self.model.addItem(name, name)
            i = self.model.count() - 1
        self.model.setCurrentIndex(max(i, 0))

    def fill(
        self,
        raw: dict[str, Any],
        text: str,
        file: str,
        effective: dict[str, Any] | None = None,
        from_file: dict[str, Any] | None = None,
    ) -> None:
        """Show what the agent runs with (``effective``; an older agent sends none: the file
        then), and mark each setting that runs otherwise than the file says."""
        v = flatten(effective) if effective is not None else flatten(from_file) if from_file is not None else {}
        fv = flatten(raw)

        def get(key: str, default: Any) -> Any:
            got = v.get(key, fv.get(key))
            return default if got is None else got

        self.cluster.setText(str(get("cluster_id", "default")))
        self.name.setText(str(get("name", "")))
        self.port.setValue(int(get("port", 7700)))
        self.api_port.setValue(int(get("api_port", 7701)))
        self.mdns.setChecked(bool(get("discovery.mdns", True)))
        self.peers.setText(", ".join(get("discovery.static_peers", [])))
        self._pick_model(get("serve.model", None))
        self.weights.setCurrentText(str(get("serve.weights", "")))
        self.serve_port.setValue(int(get("serve.api_port", 8000)))
        self.models_dir.setText(str(get("models_dir", "")))
        self.log_level.setCurrentText(str(get("log_level", "debug")))
        self.autostart.setChecked(autostart.is_enabled())
        self.throttle_on.setChecked(bool(get("throttle.enabled", True)))
        self.idle_minutes.setValue(float(get("throttle.idle_minutes", 2)))
        _pick(self.while_in_use, get("throttle.while_in_use", "pause"))
        self.temp_high.setValue(int(get("throttle.temp_high_c", 90)))
        self.temp_low.setValue(int(get("throttle.temp_low_c", 80)))
        _pick(self.on_battery, get("throttle.on_battery", "pause"))
        self.battery_floor.setValue(int(get("throttle.battery_floor_pct", 30)))
        self.hours.setText(str(get("throttle.hours", "")))
        self.text.setPlainText(text)
        tray = load_tray_settings()
        self.coordinator_url.setText(tray.get("coordinator_url") or "")
        self.api_key.setText(tray.get("api_key") or "")
        self.show_key.setChecked(False)
        self._mark(differing(effective, from_file))
        self.filled = self.form()
        self.message.setText(f"settings file: {file}")
        self._check_url()  # a bad URL already in tray.json is pointed out at once

    def _mark(self, differ: dict[str, tuple[Any, Any]]) -> None:
        """Mark the settings that run otherwise than the file says (the label, its tooltip, and a
        line under the tabs); only those the form shows are marked on a row."""
        self.differ = differ
        for key, (lab, widget) in self.rows.items():
            if key in differ:
                run, file = differ[key]
                tip = (
                    f"The agent runs with {shown(run)}; the file says {shown(file)} (set on the agent's "
                    "command line, by this laptop's cluster certificate, or changed since it started)"
                )
                lab.setText(f"{LABELS[key]} {DIFFER_MARK}")
                lab.setStyleSheet(f"color:{DIFFER_COLOUR}")
                lab.setToolTip(tip)
                widget.setToolTip(tip)
            else:
                lab.setText(LABELS[key])
                lab.setStyleSheet("")
                lab.setToolTip("")
        words = [f"{label(k)} runs as {shown(r)} (the file says {shown(f)})" for k, (r, f) in differ.items()]
        self.running.setText(
            f"{DIFFER_MARK} Running otherwise than the settings file says: " + "; ".join(words) + "." if words else ""
        )
        self.running.setVisible(bool(words))

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
            "serve.model": _combo_value(self.model),
            "serve.weights": self.weights.currentText(),
            "serve.api_port": self.serve_port.value() if self.serve_port.value() != 8000 else None,
            "models_dir": self.models_dir.text().strip(),
            "log_level": self.log_level.currentText() if self.log_level.currentText() != "debug" else None,
            # the throttle: what differs from the agent's defaults
            "throttle.enabled": None if self.throttle_on.isChecked() else False,
            "throttle.idle_minutes": _unless(self.idle_minutes.value(), 2.0),
            "throttle.while_in_use": _unless(self.while_in_use.currentData(), "pause"),
            "throttle.temp_high_c": _unless(self.temp_high.value(), 90),
            "throttle.temp_low_c": _unless(self.temp_low.value(), 80),
            "throttle.on_battery": _unless(self.on_battery.currentData(), "pause"),
            "throttle.battery_floor_pct": _unless(self.battery_floor.value(), 30),
            "throttle.hours": self.hours.text().strip(),
        }

    def changes(self) -> dict[str, Any]:
        """What the user changed in the form since it was filled: only that is written (a setting
        shown as it runs, otherwise than the file says, is not written back unless changed)."""
        return {k: v for k, v in self.form().items() if v != self.filled.get(k)}

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
                r = await self.client.put_settings(merge(self.raw, self.changes()))
        except ApiError as e:
            self.message.setText(f"not saved: {human_error(str(e))}")
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
            msg += f". {restart_words(list(r['restart']))}"
            msg += "; restarting it now." if self.restart_agent() else "; restart it to apply them."
        await self.async_load()
        self.message.setText(f"{model_msg}. {msg}" if model_msg else msg)
        self.saved.set()
        return True


def _modes() -> QComboBox:
    box = QComboBox()
    for value, words in MODES:
        box.addItem(words, value)
    return box


def _pick(box: QComboBox, value: Any) -> None:
    i = box.findData(value)
    box.setCurrentIndex(max(i, 0))
