"""The first-run window: what lakeshard does on this laptop, and the four choices it needs.

It says in plain words what runs here and when it steps aside (from the throttle settings the
agent runs with), then offers: Create a new cluster or Join one with a pasted token (the same
local API calls as the tray's *Create a new cluster…* and *Join a cluster…*, :mod:`gui.cluster`;
the agent's one-line error is shown in the window as it is), the hours this laptop may
contribute (``throttle.hours`` and ``throttle.days`` in the agent's settings, written through
``PUT /v1/settings`` on Finish), and start at login (:mod:`gui.autostart`).

The tray opens it on its first start; once it is dismissed (Finish, Not now, or closed) that is
remembered in the tray's own settings (``tray.json``, :func:`gui.settings.tray_settings_file`)
and it is not opened again by itself. The tray's menu opens it at any time (*Set up this
laptop…*). Requests run as asyncio tasks on the Qt loop and report through Qt signals; nothing
waits on the GUI thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import Qt, QTime, Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QDialog,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QRadioButton,
    QTimeEdit,
    QVBoxLayout,
    QWidget,
)

from agent.protocol.codec import ProtocolError
from agent.protocol.status import NO_CLUSTER, NodeStatus
from gui import autostart
from gui.client import ApiError, Client, Unreachable
from gui.icons import app_icon
from gui.settings import human_error, load_tray_settings, save_tray_settings
from gui.state import span

DONE_KEY = "first_run_done"  # in tray.json: the window was dismissed once
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # as throttle.days spells them
DAY_NAMES = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
WORKDAYS = DAYS[:5]
WORKING_HOURS = "08:00-19:00"
TITLE = "Set up lakeshard on this laptop"
ERROR_COLOUR = "#b91c1c"
DONE_COLOUR = "#15803d"


def done() -> bool:
    """Whether the first-run window was dismissed once (the tray then does not open it by itself)."""
    return bool(load_tray_settings().get(DONE_KEY))


def mark_done() -> None:
    tray = load_tray_settings()
    if not tray.get(DONE_KEY):
        tray[DONE_KEY] = True
        save_tray_settings(tray)


@dataclass(frozen=True)
class Hours:
    """When this laptop may contribute: ``hours`` a span of the day ("08:00-19:00"; it may wrap
    midnight; None: the whole day) on ``days`` (None: every day)."""

    hours: str | None = None
    days: tuple[str, ...] | None = None

    @property
    def any_time(self) -> bool:
        return self.hours is None and self.days is None

    @property
    def working_hours(self) -> bool:
        return self.hours == WORKING_HOURS and self.days == WORKDAYS


ANY_TIME = Hours()
WORK = Hours(WORKING_HOURS, WORKDAYS)


def hours_of(throttle: Any) -> Hours:
    """The hours a ``throttle`` settings mapping gives (pure; every day listed means every day)."""
    t = throttle if isinstance(throttle, dict) else {}
    hours, days = t.get("hours"), t.get("days")
    listed = {str(x).lower()[:3] for x in days} if isinstance(days, list) else set()
    picked = tuple(d for d in DAYS if d in listed)
    return Hours(str(hours) if hours else None, None if not picked or len(picked) == len(DAYS) else picked)


def with_hours(raw: dict[str, Any], h: Hours) -> dict[str, Any]:
    """The settings mapping ``raw`` with ``throttle.hours`` and ``throttle.days`` as ``h`` says
    (pure; "any time" removes them, and an emptied ``throttle`` section goes)."""
    out = dict(raw)
    th = dict(out.get("throttle") or {})
    th.pop("hours", None)
    th.pop("days", None)
    if h.hours is not None:
        th["hours"] = h.hours
    if h.days is not None:
        th["days"] = list(h.days)
    if th:
        out["throttle"] = th
    else:
        out.pop("throttle", None)
    return out


def hours_words(h: Hours) -> str:
    """'any time', 'from 08:00 to 19:00, Mon-Fri' (pure)."""
    if h.any_time:
        return "any time"
    when = "all day" if h.hours is None else "from {} to {}".format(*h.hours.split("-"))
    if h.days is None:
        return f"{when}, every day"
    if h.days == WORKDAYS:
        return f"{when}, Mon-Fri"
    return f"{when}, " + ", ".join(DAY_NAMES[DAYS.index(d)] for d in h.days)


def steps_aside(throttle: Any) -> list[str]:
    """When this laptop steps aside, in words, from the throttle settings the agent runs with
    (pure; an older agent, or none read yet, gives the defaults)."""
    t = throttle if isinstance(throttle, dict) else {}
    if t.get("enabled") is False:
        return ["stepping aside is turned off in Settings: it contributes whenever the agent runs"]
    idle = float(t.get("idle_minutes", 2))
    out = []
    use = t.get("while_in_use", "pause")
    if use == "pause":
        out.append(f"while you use it (keyboard or mouse): it pauses at once, and goes on after {span(idle)} idle")
    elif use == "limit":
        out.append(f"while you use it: it contributes less, at low priority, and fully after {span(idle)} idle")
    high, low = t.get("temp_high_c", 90), t.get("temp_low_c", 80)
    out.append(f"when it runs hot: it pauses at {high:g} °C, until it cools to {low:g} °C")
    battery, floor = t.get("on_battery", "pause"), t.get("battery_floor_pct", 30)
    if battery == "pause":
        out.append("on battery: it pauses until the laptop is plugged in")
    elif battery == "limit":
        out.append(f"on battery: it contributes less, and pauses below {floor:g} % charge")
    else:
        out.append(f"on battery: it pauses below {floor:g} % charge")
    if t.get("cpu_high_pct", 60) not in ("off", False):
        out.append("when your other programs keep the processor busy: it contributes less")
    return out


def _section(title: str) -> tuple[QGroupBox, QVBoxLayout]:
    box = QGroupBox(title)
    lay = QVBoxLayout(box)
    return box, lay


def _label(text: str = "") -> QLabel:
    lab = QLabel(text)
    lab.setWordWrap(True)
    lab.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return lab


class FirstRunWindow(QDialog):
    """Welcome, and set up this laptop: cluster, hours, start at login. ``load`` (again on each
    opening) reads what the agent says now; ``finish`` writes the choices and closes."""

    cluster_changed = Signal(object)  # the agent's answer to a create or a join (dict)
    cluster_failed = Signal(str)  # the agent's one-line error for a create or a join
    node_read = Signal(object)  # the agent's /v1/node (NodeStatus), or the error in words (str)

    def __init__(self, client: Client) -> None:
        super().__init__()
        self.client = client
        self.setWindowTitle(TITLE)
        self.setWindowIcon(app_icon())
        self.resize(640, 620)
        self.node: NodeStatus | None = None
        self.loaded: Hours | None = None  # the hours the agent had when the window was filled
        self._tasks: list[asyncio.Task[Any]] = []

        head = QLabel("<h2>Welcome to lakeshard</h2>")
        # 1. what it does
        what, wl = _section("What lakeshard does on this laptop")
        self.about = _label()
        self.about.setTextFormat(Qt.TextFormat.RichText)
        wl.addWidget(self.about)
        self._explain(None)
        # 2. the cluster
        cluster, cl = _section("Your cluster")
        self.cluster_status = _label("asking the agent…")
        self.create_btn = QPushButton("Create a new cluster")
        self.create_btn.setToolTip(
            "For the first laptop of your office: it keeps the cluster's keys and invites the others "
            "(the tray's Invite a laptop…)"
        )
        self.create_btn.clicked.connect(self.create_cluster)
        self.token = QLineEdit()
        self.token.setPlaceholderText("or paste a join token (lsj1-…) from a laptop of the cluster")
        self.token.returnPressed.connect(self.join)
        self.join_btn = QPushButton("Join")
        self.join_btn.clicked.connect(self.join)
        row = QHBoxLayout()
        row.addWidget(self.create_btn)
        row.addWidget(self.token, 1)
        row.addWidget(self.join_btn)
        self.cluster_row = QWidget()
        self.cluster_row.setLayout(row)
        row.setContentsMargins(0, 0, 0, 0)
        self.cluster_message = _label()  # how a create or a join went (hidden while there is nothing to say)
        self.cluster_message.setVisible(False)
        cl.addWidget(self.cluster_status)
        cl.addWidget(self.cluster_row)
        cl.addWidget(self.cluster_message)
        # 3. the hours
        hours, hl = _section("When it may contribute")
        self.any_time = QRadioButton("Any time (whenever the laptop is on and you leave it idle)")
        self.work = QRadioButton("Working hours: 08:00 to 19:00, Monday to Friday")
        self.custom = QRadioButton("These hours:")
        self.choice = QButtonGroup(self)
        for b in (self.any_time, self.work, self.custom):
            self.choice.addButton(b)
        self.start_time = QTimeEdit(QTime(8, 0))
        self.end_time = QTimeEdit(QTime(19, 0))
        for t in (self.start_time, self.end_time):
            t.setDisplayFormat("HH:mm")
        self.end_time.setToolTip("An end before the start wraps midnight; the same as the start: all day")
        self.day_boxes = [QCheckBox(name) for name in DAY_NAMES]
        for box, day in zip(self.day_boxes, DAYS, strict=True):
            box.setChecked(day in WORKDAYS)
        times = QHBoxLayout()
        times.addWidget(self.custom)
        times.addWidget(QLabel("from"))
        times.addWidget(self.start_time)
        times.addWidget(QLabel("to"))
        times.addWidget(self.end_time)
        times.addStretch(1)
        days = QHBoxLayout()
        days.setContentsMargins(24, 0, 0, 0)
        for box in self.day_boxes:
            days.addWidget(box)
        days.addStretch(1)
        self.custom_widgets: list[QWidget] = [self.start_time, self.end_time, *self.day_boxes]
        self.custom.toggled.connect(self._custom_on)
        hl.addWidget(self.any_time)
        hl.addWidget(self.work)
        hl.addLayout(times)
        hl.addLayout(days)
        self._pick(ANY_TIME)
        # 4. start at login
        login, ll = _section("Start at login")
        self.autostart = QCheckBox("Start lakeshard when I log in (recommended: it contributes only while it runs)")
        self.autostart.setChecked(autostart.is_enabled())
        ll.addWidget(self.autostart)
        # the end
        self.message = _label()
        self.later_btn = QPushButton("Not now")
        self.later_btn.setToolTip("Close; the tray's Set up this laptop… opens this again")
        self.later_btn.clicked.connect(self.reject)
        self.finish_btn = QPushButton("Finish")
        self.finish_btn.setDefault(True)
        self.finish_btn.clicked.connect(self.finish)
        buttons = QHBoxLayout()
        buttons.addWidget(_label("You can change all of this later in the tray's Settings."), 1)
        buttons.addWidget(self.later_btn)
        buttons.addWidget(self.finish_btn)
        lay = QVBoxLayout(self)
        lay.addWidget(head)
        for w in (what, cluster, hours, login):
            lay.addWidget(w)
        lay.addStretch(1)
        lay.addWidget(self.message)
        lay.addLayout(buttons)

        self.cluster_changed.connect(self._on_cluster_changed)
        self.cluster_failed.connect(self._on_cluster_failed)
        self.node_read.connect(self._show_node)
        self.finished.connect(lambda _result: mark_done())  # dismissed: not opened again by itself

    # -- what is shown -----------------------------------------------------------------------------
    def _explain(self, throttle: Any) -> None:
        items = "".join(f"<li>{line}</li>" for line in steps_aside(throttle))
        self.about.setText(
            "lakeshard pools the idle laptops of your office into one AI chat assistant: each laptop of "
            "a cluster computes a part of every answer, and the model runs on your own laptops, not in "
            "someone else's cloud. Open the chat from the tray icon.<br><br>"
            "Here it runs in the background and uses only what you leave idle. It steps aside by itself:"
            f"<ul style='margin-top:2px'>{items}<li>outside the hours you choose below</li></ul>"
            "Pause it from the tray icon at any time."
        )

    def _show_node(self, node: NodeStatus | str) -> None:
        """The cluster section for what the agent says (a string: why it could not be asked)."""
        if isinstance(node, str):
            self.node = None
            self.cluster_status.setText(f"The agent does not answer yet: {node}")
            self.cluster_row.setEnabled(True)
            return
        self.node = node
        if node.state == NO_CLUSTER:
            self.cluster_status.setText(
                "This laptop is not in a cluster yet. On the first laptop of your office, create one; "
                "on the others, paste a join token made on a laptop of the cluster (its tray's "
                "<i>Invite a laptop…</i>)."
            )
            self.cluster_row.setEnabled(True)
            return
        where = f"cluster {node.cluster}" if node.cluster else "a cluster"
        text = f"This laptop is in {where} as {node.name or node.node}."
        if node.holds_ca:
            text += " It holds the cluster's keys: add laptops with the tray's <i>Invite a laptop…</i>."
        self.cluster_status.setText(text)
        self.cluster_row.setEnabled(False)

    def _pick(self, h: Hours) -> None:
        if h.any_time:
            self.any_time.setChecked(True)
        elif h.working_hours:
            self.work.setChecked(True)
        else:
            self.custom.setChecked(True)
            a, b = (h.hours or "00:00-00:00").split("-")
            self.start_time.setTime(QTime.fromString(a.strip().rjust(5, "0"), "HH:mm"))
            self.end_time.setTime(QTime.fromString(b.strip().rjust(5, "0"), "HH:mm"))
            for box, day in zip(self.day_boxes, DAYS, strict=True):
                box.setChecked(h.days is None or day in h.days)
        self._custom_on(self.custom.isChecked())

    def _custom_on(self, on: bool) -> None:
        for w in self.custom_widgets:
            w.setEnabled(on)

    def chosen(self) -> Hours:
        """The hours picked in the window; ValueError (in words) when they are no hours at all."""
        if self.any_time.isChecked():
            return ANY_TIME
        if self.work.isChecked():
            return WORK
        days = tuple(d for box, d in zip(self.day_boxes, DAYS, strict=True) if box.isChecked())
        if not days:
            raise ValueError("choose at least one day it may contribute on")
        a, b = self.start_time.time().toString("HH:mm"), self.end_time.time().toString("HH:mm")
        return Hours(None if a == b else f"{a}-{b}", None if len(days) == len(DAYS) else days)

    # -- loading ----------------------------------------------------------------------------------
    def load(self) -> None:
        """Read what the agent says now (its cluster, its hours), off the GUI thread."""
        self._spawn(self.async_load())

    async def async_load(self) -> None:
        self.message.setText("")
        self._cluster_say("")
        self.autostart.setChecked(autostart.is_enabled())
        await self.async_read_node()
        try:
            cur = await self.client.settings()
        except (ApiError, Unreachable) as e:
            self.loaded = None
            self.message.setText(f"The agent's settings cannot be read yet ({e}); Finish tries again.")
            return
        effective = cur.get("effective") or cur.get("from_file") or cur.get("settings") or {}
        throttle = effective.get("throttle") if isinstance(effective, dict) else None
        self._explain(throttle)
        self.loaded = hours_of(throttle)
        self._pick(self.loaded)

    async def async_read_node(self) -> None:
        try:
            self.node_read.emit(NodeStatus.parse(await self.client.node()))
        except (ApiError, Unreachable) as e:
            self.node_read.emit(str(e))
        except ProtocolError as e:
            self.node_read.emit(f"its status does not read ({e})")

    # -- the cluster --------------------------------------------------------------------------------
    def create_cluster(self) -> None:
        """Make this laptop the first of a new cluster (it will hold the cluster's keys)."""
        self._busy("making a new cluster…")
        self._spawn(self._cluster(self.client.cluster_init()))

    def join(self) -> None:
        token = self.token.text().strip()
        if not token:
            self._cluster_say(
                "Paste a join token first (a laptop of the cluster makes one: its tray's Invite a laptop…)."
            )
            return
        self._busy("joining… (this laptop asks the cluster member the token names; up to a minute)")
        self._spawn(self._cluster(self.client.cluster_join(token)))

    def _busy(self, text: str) -> None:
        self.create_btn.setEnabled(False)
        self.join_btn.setEnabled(False)
        self._cluster_say(text)

    async def _cluster(self, call: Awaitable[dict[str, Any]]) -> None:
        try:
            r = await call
        except (ApiError, Unreachable) as e:
            self.cluster_failed.emit(str(e))
            return
        self.cluster_changed.emit(r)
        await self.async_read_node()

    def _on_cluster_failed(self, error: str) -> None:
        self.create_btn.setEnabled(True)
        self.join_btn.setEnabled(True)
        self._cluster_say(f"Not done: {error}", ERROR_COLOUR)

    def _on_cluster_changed(self, r: dict[str, Any]) -> None:
        self.create_btn.setEnabled(True)
        self.join_btn.setEnabled(True)
        msg = str(r.get("message") or "done")
        if r.get("agent_error"):
            self._cluster_say(f"{msg}, but the agent could not start as a member: {r['agent_error']}", ERROR_COLOUR)
            return
        self.token.clear()
        self._cluster_say(f"Done: {msg}.", DONE_COLOUR)

    def _cluster_say(self, text: str, colour: str = "") -> None:
        self.cluster_message.setStyleSheet(f"color:{colour}" if colour else "")
        self.cluster_message.setText(text)
        self.cluster_message.setVisible(bool(text))

    # -- finishing ------------------------------------------------------------------------------------
    def finish(self) -> None:
        self._spawn(self.async_finish())

    async def async_finish(self) -> bool:
        """Write the hours to the agent's settings and start at login; close when both are done
        (an error stays in the window, and nothing closes)."""
        try:
            h = self.chosen()
        except ValueError as e:
            self.message.setText(f"Not finished: {e}.")
            return False
        self.finish_btn.setEnabled(False)
        try:
            return await self._finish(h)
        finally:
            self.finish_btn.setEnabled(True)

    async def _finish(self, h: Hours) -> bool:
        self.message.setText("saving…")
        try:  # read the file again: only the hours change, whatever else was set meanwhile
            cur = await self.client.settings()
            raw = dict(cur.get("settings") or {})
            new = with_hours(raw, h)
            if new != raw:
                await self.client.put_settings(new)
        except ApiError as e:
            self.message.setText(f"Not saved: {human_error(str(e))}")
            return False
        except Unreachable as e:
            self.message.setText(f"Not saved: the agent does not answer ({e})")
            return False
        on = self.autostart.isChecked()
        try:
            if on != autostart.is_enabled():
                autostart.set_enabled(on)
        except OSError as e:
            self.message.setText(f"The hours are saved ({hours_words(h)}), but start at login was not changed: {e}")
            return False
        self.loaded = h
        self.message.setText(f"Saved: it contributes {hours_words(h)}; start at login {'on' if on else 'off'}.")
        self.accept()
        return True

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.ensure_future(coro))
