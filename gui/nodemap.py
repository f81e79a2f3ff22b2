"""The node map (for admins): the cluster as its coordinator sees it, live.

Fed only by the coordinator's event stream (through the tray): each node with its name,
state colour and icon (a legend under the map says which is which), device, layer range,
memory, temperature and tok/s; the ring in stage order with each link's round trip, its label
beside the link and clear of the others; the coordinator marked; re-plans and failovers in the
log as they happen. A node keeps its place on the map while it stays in the cluster (places go
by node, in the order they came, never by the plan's stage order), so a re-plan moves arrows,
not boxes. The log writes a plan only when every node of it can serve: while the coordinator
re-plans, its view still holds the outgoing ring (a node that just paused or died), which the
log names as the reason instead of as a plan. Clicking a node shows its details; this laptop's own
node can be paused, excluded from or preferred for coordinating; on the laptop that holds the
cluster's CA, another node can be revoked (after a confirmation): every member then refuses it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import (
    QBrush,
    QColor,
    QFont,
    QFontMetricsF,
    QMouseEvent,
    QPainter,
    QPainterPath,
    QPaintEvent,
    QPen,
    QPixmap,
)
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QListWidget,
    QMainWindow,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from agent.protocol.cluster_view import ClusterView, NodeInfo, NodeStep, Preparation
from agent.protocol.events import (
    CoordinatorLost,
    Event,
    Failover,
    NodeChanged,
    NodeJoined,
    NodeLeft,
    PlanChanged,
    Snapshot,
    StreamFinished,
    Takeover,
)
from gui.client import ApiError, Client, Unreachable
from gui.icons import FALLBACK_COLOURS, app_icon, state_icon
from gui.state import TrayState, reason_kind

# the legend: what a node's colour bar and icon say (the tray's own icons, one per state)
LEGEND: tuple[tuple[TrayState, str], ...] = (
    (TrayState.AVAILABLE, "available"),
    (TrayState.SERVING, "serving"),
    (TrayState.COORDINATOR, "★ coordinator"),
    (TrayState.LIMITED, "limited (busy or warm)"),
    (TrayState.PAUSED_USER, "paused (its user)"),
    (TrayState.PAUSED_HEAT, "paused (heat or battery)"),
)
LABEL_GAP = 10.0  # between a link and its label (clear of the arrowhead, 6 px either side of the link)
BOX_W, BOX_H = 236, 132
STEP_COLOUR = "#0369a1"  # a node's preparation step, under its figures
GIB = 1024**3


HEADER_H = 28  # the header line (cluster, term, model) above the boxes


def stable_order(before: list[str], view: ClusterView) -> list[str]:
    """The nodes' places on the map: those already placed keep their order, newcomers follow
    (by id); never the plan's stage order, so a re-plan moves no box (pure)."""
    here = {n.node for n in view.nodes}
    kept = [n for n in before if n in here]
    return kept + sorted(here - set(kept))


def layout(view: ClusterView, width: float, height: float, order: list[str] | None = None) -> dict[str, QRectF]:
    """Where each node's box goes: ``order`` (default: by node id; see :func:`stable_order`)
    clockwise from the top, all below the header line (pure)."""
    order = [n for n in (order if order is not None else sorted(n.node for n in view.nodes)) if view.node(n)]
    out: dict[str, QRectF] = {}
    k = len(order)
    below = max(height - HEADER_H, 0)
    cx, cy = width / 2, HEADER_H + below / 2
    rx, ry = max(width / 2 - BOX_W / 2 - 16, 0), max(below / 2 - BOX_H / 2 - 16, 0)
    for i, node in enumerate(order):
        a = -math.pi / 2 + 2 * math.pi * i / max(k, 1)
        x, y = (cx, cy) if k == 1 else (cx + rx * math.cos(a), cy + ry * math.sin(a))
        out[node] = QRectF(x - BOX_W / 2, y - BOX_H / 2, BOX_W, BOX_H)
    return out


def label_rects(
    centres: dict[str, QPointF], ring: list[str], sizes: dict[str, tuple[float, float]]
) -> dict[str, QRectF]:
    """Where each ring link's label goes, keyed by the link's first node (pure).

    Beside the middle of its link, on the link's right-hand side (so that the two links of a
    two-node ring, one each way along the same line, take opposite sides), wholly clear of the
    line; a label that would overlap one placed before it moves further out on its side until
    it overlaps none. ``sizes``: each label's width and height (links without one get none)."""
    out: dict[str, QRectF] = {}
    k = len(ring)
    if k < 2:
        return out
    for i, node in enumerate(ring):
        nxt = ring[(i + 1) % k]
        if node not in sizes or node not in centres or nxt not in centres:
            continue
        a, b = centres[node], centres[nxt]
        mid = (a + b) / 2
        length = math.hypot(b.x() - a.x(), b.y() - a.y())
        ux, uy = ((b.x() - a.x()) / length, (b.y() - a.y()) / length) if length else (1.0, 0.0)
        nx, ny = -uy, ux  # the right-hand normal (y grows downwards)
        w, h = sizes[node]
        dist = abs(nx) * w / 2 + abs(ny) * h / 2 + LABEL_GAP  # the whole label clear of the line
        r = QRectF()
        for _ in range(400):
            r = QRectF(mid.x() + nx * dist - w / 2, mid.y() + ny * dist - h / 2, w, h)
            if not any(r.intersects(o) for o in out.values()):
                break
            dist += max(h / 2, 4.0)
        out[node] = r
    return out


def node_icon_state(n: NodeInfo, coordinator: bool) -> TrayState:
    """The tray icon (and colour) a node's box carries: the same as its own tray shows (pure)."""
    if n.state == "paused":
        return TrayState.PAUSED_HEAT if reason_kind(n.reason) == "heat" else TrayState.PAUSED_USER
    if n.state == "limited":
        return TrayState.LIMITED
    if n.tok_s > 0 and n.layers is not None:
        return TrayState.SERVING
    return TrayState.COORDINATOR if coordinator else TrayState.AVAILABLE


def node_lines(n: NodeInfo, step: NodeStep | None = None) -> list[str]:
    """The text in a node's box (pure); ``step``: its part of a preparation under way (a last line)."""
    lines = [n.name if n.name != n.node else n.node[:12]]
    state = n.state + (f" ({n.reason})" if n.reason else "")
    lines.append(f"{state} · {','.join(n.devices)}")
    lines.append(f"layers {n.layers[0]}-{n.layers[1] - 1}" if n.layers else "no stage")
    mem = f"{n.mem_free / GIB:.1f}/{n.mem_total / GIB:.0f} GB free" if n.mem_total else "memory ?"
    temp = f" · {n.temp_c:.0f} °C" if n.temp_c is not None else ""
    lines.append(mem + temp)
    rtt = "" if n.rtt_ms is None or n.role == "coordinator" else f" · rtt {n.rtt_ms:.1f} ms"
    lines.append(f"{n.tok_s:.0f} tok/s{rtt}")
    if step is not None:
        lines.append(step.describe())
    return lines


def preparing_step(view: ClusterView, node: str) -> NodeStep | None:
    """``node``'s part of the preparation under way (None: nothing under way, or not its part)."""
    p = view.preparing
    if p is None or p.step == "ready":
        return None
    return p.node(node)


def preparing_news(before: Preparation | None, after: Preparation | None, at: float) -> str | None:
    """A line of the map's log when the preparation took a new step (its percent alone is not news)."""
    if after is None or (before is not None and before.steps() == after.steps()):
        return None
    t = time.strftime("%H:%M:%S", time.localtime(at))
    return f"{t}  {after.model}: {after.describe()}"


def link_label(ms: float) -> str:
    """A ring link's round trip as the map writes it (pure)."""
    return f"{ms * 1000:.0f} µs" if ms < 1 else f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"


REPLANNING = ("planning", "re-planning", "recovering")  # services whose ring is the outgoing one


def unfit(view: ClusterView | None, node: str) -> str | None:
    """Why ``node`` cannot serve in a plan, as the view has it (None: it can): it left, or it is paused."""
    if view is None:
        return None
    n = view.node(node)
    if n is None or not n.alive:
        return "left"
    return "paused" if n.state == "paused" else None


def plan_line(ev: PlanChanged, view: ClusterView | None, names: dict[str, str]) -> str:
    """The log's words for a plan event (pure): the ring, but only where every node of it can
    serve; while the coordinator re-plans (its view still holds the outgoing ring), or where a
    node of the ring paused or left, the reason instead, never that ring as a plan."""
    why = [f"{names.get(n, n)} {w}" for n in ev.ring if (w := unfit(view, n)) is not None]
    if ev.service in REPLANNING:
        return f"{ev.service}…" + (f" ({', '.join(why)})" if why else "")
    if why:
        return f"{ev.service}: waiting for a plan without {', '.join(why)}"
    ring = " → ".join(f"{names.get(n, n)} [{a}-{b - 1}]" for n, (a, b) in zip(ev.ring, ev.layers, strict=True))
    return f"plan ({ev.service}): {ring or 'no stages'}"


def describe(ev: Event, names: dict[str, str], view: ClusterView | None = None) -> str | None:
    """One line of the map's log for an event worth a line (pure); ``view``: the cluster with
    ``ev`` applied (a plan is checked against it)."""
    t = time.strftime("%H:%M:%S", time.localtime(ev.at))

    def name(n: str) -> str:
        return names.get(n, n)

    if isinstance(ev, NodeJoined):
        return f"{t}  {ev.node.name} joined"
    if isinstance(ev, NodeLeft):
        return f"{t}  {ev.name or ev.node} left (no beats)"
    if isinstance(ev, NodeChanged) and ({"state", "role"} & set(ev.changed)):
        why = f" ({ev.node.reason})" if ev.node.reason else ""
        return f"{t}  {ev.node.name}: {ev.node.state}{why}, {ev.node.role}"
    if isinstance(ev, PlanChanged):
        return f"{t}  {plan_line(ev, view, names)}"
    if isinstance(ev, Failover):
        return f"{t}  failover: lost {name(ev.lost)}, streams resumed in {ev.seconds:.1f} s"
    if isinstance(ev, Takeover):
        again = "exported again" if ev.exported else "nothing exported again"
        return (
            f"{t}  {name(ev.coordinator)} took over in {ev.seconds:.1f} s: {ev.kept} stage(s) kept, "
            f"{ev.moved} moved, {again}"
        )
    if isinstance(ev, CoordinatorLost):
        return f"{t}  coordinator lost; election under way"
    if isinstance(ev, Snapshot):
        c = ev.view.coordinator
        return f"{t}  coordinator {name(c) if c else 'none'} (term {ev.view.term})"
    if isinstance(ev, StreamFinished):
        rate = f", {ev.tok_s:.1f} tok/s" if ev.tok_s else ""
        return f"{t}  answer {ev.outcome}: {ev.tokens} tokens{rate}"
    return None


class MapCanvas(QWidget):
    picked = Signal(str)

    def __init__(self) -> None:
        super().__init__()
        self.view: ClusterView | None = None
        self.me: str | None = None
        self.selected: str | None = None
        self.order: list[str] = []  # the nodes' places, kept across re-plans (stable_order)
        self.setMinimumSize(520, 420)

    def set_view(self, view: ClusterView | None, me: str | None) -> None:
        self.view, self.me = view, me
        if view is not None:
            self.order = stable_order(self.order, view)
        self.update()

    def boxes(self) -> dict[str, QRectF]:
        return {} if self.view is None else layout(self.view, self.width(), self.height(), self.order)

    def labels(self) -> dict[str, tuple[str, QRectF]]:
        """Each ring link's round-trip label and where it goes, keyed by the link's first node."""
        v = self.view
        if v is None:
            return {}
        boxes = self.boxes()
        ring = [n for n in v.ring if n in boxes]
        fm = QFontMetricsF(self.font())
        texts = {n: link_label(info.next_rtt_ms) for n in ring if (info := v.node(n)) and info.next_rtt_ms is not None}
        sizes = {n: (fm.horizontalAdvance(t) + 8, fm.height() + 2) for n, t in texts.items()}
        rects = label_rects({n: r.center() for n, r in boxes.items()}, ring, sizes)
        return {n: (texts[n], r) for n, r in rects.items()}

    def node_at(self, p: QPointF) -> str | None:
        return next((n for n, r in self.boxes().items() if r.contains(p)), None)

    def mousePressEvent(self, e: QMouseEvent) -> None:
        n = self.node_at(e.position())
        if n is not None:
            self.selected = n
            self.picked.emit(n)
            self.update()

    def paintEvent(self, _e: QPaintEvent) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        p.fillRect(self.rect(), QColor("#f8fafc"))
        v = self.view
        if v is None or not v.nodes:
            p.setPen(QColor("#64748b"))
            p.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, "waiting for the coordinator's event stream…")
            return
        boxes = self.boxes()
        ring = [n for n in v.ring if n in boxes]
        pen = QPen(QColor("#0e7490"), 3)
        p.setPen(pen)
        for i, n in enumerate(ring):  # the ring: stage i -> stage i+1, the last back to the first
            if len(ring) < 2:
                break
            a, b = boxes[n].center(), boxes[ring[(i + 1) % len(ring)]].center()
            p.drawLine(a, b)
            _arrow(p, a, b)
        for node, r in boxes.items():
            info = v.node(node)
            if info is not None:
                self._box(p, r, info, node == v.coordinator, node == self.me, preparing_step(v, node))
        for text, r in self.labels().values():  # on top: never under a box or a line
            path = QPainterPath()
            path.addRoundedRect(r, 4, 4)
            p.fillPath(path, QBrush(QColor(255, 255, 255, 230)))
            p.setPen(QColor("#0f172a"))
            p.drawText(r, Qt.AlignmentFlag.AlignCenter, text)
        p.setPen(QColor("#334155"))
        model = f"{v.model or 'no model'} ({v.service})"
        if v.preparing is not None and v.preparing.step != "ready":
            model = f"{v.model or v.preparing.model} ({v.preparing.describe()})"
        head = f"{v.cluster} · term {v.term} · {model} · {v.streams} answering · ★ coordinator"
        p.drawText(QRectF(8, 4, self.width() - 16, HEADER_H - 8), Qt.AlignmentFlag.AlignLeft, head)

    def _box(self, p: QPainter, r: QRectF, n: NodeInfo, coordinator: bool, me: bool, step: NodeStep | None) -> None:
        path = QPainterPath()
        path.addRoundedRect(r, 10, 10)
        p.setBrush(Qt.BrushStyle.NoBrush)
        p.fillPath(path, QBrush(QColor("#ffffff")))
        selected = n.node == self.selected
        border = QColor("#2563eb") if coordinator else QColor("#0ea5e9" if selected else "#cbd5e1")
        p.setPen(QPen(border, 4 if coordinator or selected else 1.5))
        p.drawPath(path)
        icon = node_icon_state(n, coordinator)
        p.fillRect(QRectF(r.left() + 1, r.top() + 8, 8, r.height() - 16), QColor(FALLBACK_COLOURS[icon]))
        p.drawPixmap(int(r.right()) - 24, int(r.top()) + 6, state_icon(icon).pixmap(18, 18))
        lines = node_lines(n, step)
        f = QFont(self.font())
        f.setBold(True)
        p.setFont(f)
        p.setPen(QColor("#0f172a"))
        title = ("★ " if coordinator else "") + lines[0] + (" (this laptop)" if me else "")
        p.drawText(QRectF(r.left() + 16, r.top() + 6, r.width() - 44, 18), Qt.AlignmentFlag.AlignLeft, title)
        f.setBold(False)
        p.setFont(f)
        p.setPen(QColor("#334155"))
        for i, line in enumerate(lines[1:]):
            if step is not None and i == len(lines) - 2:
                p.setPen(QColor(STEP_COLOUR if step.step != "failed" else "#b91c1c"))
            p.drawText(
                QRectF(r.left() + 16, r.top() + 26 + 20 * i, r.width() - 20, 18), Qt.AlignmentFlag.AlignLeft, line
            )


def _arrow(p: QPainter, a: QPointF, b: QPointF) -> None:
    """An arrowhead on a -> b (the ring's direction), a little before halfway: the two links of a
    two-node ring, one each way along the same line, show two arrowheads, not one on the other."""
    mid = a + (b - a) * 0.4
    d = b - a
    length = math.hypot(d.x(), d.y()) or 1.0
    ux, uy = d.x() / length, d.y() / length
    tip = QPointF(mid.x() + 8 * ux, mid.y() + 8 * uy)
    left = QPointF(mid.x() - 8 * ux - 6 * uy, mid.y() - 8 * uy + 6 * ux)
    right = QPointF(mid.x() - 8 * ux + 6 * uy, mid.y() - 8 * uy - 6 * ux)
    path = QPainterPath(tip)
    path.lineTo(left)
    path.lineTo(right)
    path.closeSubpath()
    p.fillPath(path, QBrush(QColor("#0e7490")))


class Legend(QWidget):
    """What the colours and icons of the map say: one entry per state a node shows (:data:`LEGEND`)."""

    def __init__(self) -> None:
        super().__init__()
        row = QHBoxLayout(self)
        row.setContentsMargins(8, 2, 8, 2)
        self.entries: dict[TrayState, QLabel] = {}
        for state, words in LEGEND:
            swatch = QLabel()
            pm = QPixmap(8, 16)
            pm.fill(QColor(FALLBACK_COLOURS[state]))
            swatch.setPixmap(pm)
            icon = QLabel()
            icon.setPixmap(state_icon(state).pixmap(16, 16))
            text = QLabel(words)
            text.setStyleSheet("color:#334155")
            for w in (swatch, icon, text):
                row.addWidget(w)
            row.addSpacing(10)
            self.entries[state] = text
        row.addStretch(1)


class NodeMapWindow(QMainWindow):
    def __init__(
        self,
        client: Client,
        me: Callable[[], str | None] = lambda: None,
        holds_ca: Callable[[], bool] = lambda: False,
        confirm: Callable[[str, str], bool] | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.me = me
        self.holds_ca = holds_ca  # whether this laptop holds the cluster's CA (it may revoke nodes)
        self.confirm = confirm or _ask
        self.view: ClusterView | None = None
        self.names: dict[str, str] = {}
        self.log_lines: list[str] = []
        self.setWindowTitle("lakeshard node map")
        self.setWindowIcon(app_icon())
        self.resize(1080, 700)
        self.canvas = MapCanvas()
        self.canvas.picked.connect(self.show_node)
        self.details = QLabel("Click a node for its details.")
        self.details.setWordWrap(True)
        self.details.setAlignment(Qt.AlignmentFlag.AlignTop)
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.pause_btn = QPushButton("Pause this node")
        self.pause_btn.clicked.connect(self._toggle_pause)
        self.exclude_btn = QPushButton("Never coordinate")
        self.exclude_btn.clicked.connect(lambda: self._election("exclude"))
        self.prefer_btn = QPushButton("Prefer as coordinator")
        self.prefer_btn.clicked.connect(lambda: self._election("preferred"))
        self.revoke_btn = QPushButton("Revoke this laptop…")
        self.revoke_btn.clicked.connect(self.revoke_selected)
        self.note = QLabel("")
        self.note.setWordWrap(True)
        self.note.setStyleSheet("color:#6b7280")
        side = QWidget()
        sv = QVBoxLayout(side)
        sv.addWidget(self.details, 1)
        for b in (self.pause_btn, self.exclude_btn, self.prefer_btn, self.revoke_btn):
            sv.addWidget(b)
        sv.addWidget(self.note)
        self.log = QListWidget()
        self.legend = Legend()
        left = QWidget()
        lv = QVBoxLayout(left)
        lv.setContentsMargins(0, 0, 0, 0)
        lv.addWidget(self.canvas, 1)
        lv.addWidget(self.legend)
        top = QSplitter()
        top.addWidget(left)
        top.addWidget(side)
        top.setSizes([760, 300])
        outer = QSplitter(Qt.Orientation.Vertical)
        outer.addWidget(top)
        outer.addWidget(self.log)
        outer.setSizes([540, 160])
        holder = QWidget()
        lay = QHBoxLayout(holder)
        lay.addWidget(outer)
        self.setCentralWidget(holder)
        self.selected: str | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._enable_actions()

    def on_event(self, item: tuple[Event, ClusterView | None]) -> None:
        ev, view = item
        before = self.view.preparing if self.view is not None else None
        self.view = view
        if view is not None:
            self.names.update({n.node: n.name for n in view.nodes})
        lines = [describe(ev, self.names, view), preparing_news(before, view.preparing if view else None, ev.at)]
        for line in lines:
            if line is not None:
                self.log_lines.append(line)
                self.log.addItem(line)
                self.log.scrollToBottom()
        self.canvas.set_view(view, self.me())
        if self.selected is not None:
            self.show_node(self.selected)

    def show_node(self, node: str) -> None:
        if node != self.selected:
            self.note.setText("")  # an action's result belongs to the node it was taken on
        self.selected = node
        n = self.view.node(node) if self.view is not None else None
        if n is None:
            self.details.setText(f"<b>{self.names.get(node, node)}</b><br>not in the cluster any more")
        else:
            rows = [
                ("node", n.node),
                ("address", n.address),
                ("role", n.role + (" (this laptop)" if node == self.me() else "")),
                ("state", n.state + (f": {n.reason}" if n.reason else "")),
                ("devices", ", ".join(n.devices)),
                ("speed", f"{n.score:.0f} GFLOP/s"),
                ("memory", f"{n.mem_free / GIB:.1f} GB free of {n.mem_total / GIB:.1f}"),
                ("temperature", "unknown" if n.temp_c is None else f"{n.temp_c:.0f} °C"),
                ("stage", "none" if n.stage is None else f"{n.stage}, layers {n.layers}"),
                *((("preparing", step.describe()),) if (step := self._step(node)) else ()),
                ("tok/s", f"{n.tok_s:.1f}"),
                ("round trip", "-" if n.rtt_ms is None else f"{n.rtt_ms:.2f} ms to the coordinator"),
                (
                    "next hop",
                    "-" if n.next_rtt_ms is None else f"{link_label(n.next_rtt_ms)} there and back",
                ),
                ("version", n.version or "?"),
            ]
            body = "".join(f"<tr><td><b>{k}</b></td><td>{v}</td></tr>" for k, v in rows)
            self.details.setText(f"<h3>{n.name}</h3><table>{body}</table>")
        self._enable_actions()

    def _step(self, node: str) -> NodeStep | None:
        return preparing_step(self.view, node) if self.view is not None else None

    def _enable_actions(self) -> None:
        mine = self.selected is not None and self.selected == self.me()
        n = self.view.node(self.selected) if (self.view is not None and self.selected) else None
        for b in (self.pause_btn, self.exclude_btn, self.prefer_btn):
            b.setEnabled(mine and n is not None)
        self.pause_btn.setText("Resume this node" if n is not None and n.state == "paused" else "Pause this node")
        other = self.selected is not None and not mine
        self.revoke_btn.setEnabled(other and self.holds_ca())
        hint = "Only the laptop that holds the cluster's CA (the one that made it) can revoke another laptop."
        if other and not self.holds_ca():
            self.note.setText(hint)
        elif self.note.text() == hint:  # only the hint goes: a refresh keeps an action's result
            self.note.setText("")

    def revoke_selected(self) -> None:
        """Revoke the selected node (after a confirmation): every member refuses it from then on."""
        node = self.selected
        if node is None or node == self.me() or not self.holds_ca():
            return
        name = self.names.get(node, node)
        if not self.confirm(
            "Revoke a laptop",
            f"Revoke {name} (node {node})? Every laptop of the cluster will refuse it from now on; "
            "it can only come back by joining again with a new token.",
        ):
            return

        async def go() -> None:
            r = await self.client.cluster_revoke(node)
            self.note.setText(str(r.get("message") or f"revoked node {node}"))

        self._spawn(go())

    def _toggle_pause(self) -> None:
        n = self.view.node(self.selected) if (self.view is not None and self.selected) else None
        if n is None:
            return
        self._spawn(self.client.set_state("available" if n.state == "paused" else "paused"))

    def _election(self, key: str) -> None:
        """Add this node to ``election.exclude`` or ``election.preferred`` (and off the other)."""
        me = self.me()
        if me is None:
            return

        async def go() -> None:
            cur = await self.client.settings()
            s = dict(cur.get("settings") or {})
            el = dict(s.get("election") or {})
            other = "preferred" if key == "exclude" else "exclude"
            el[other] = [x for x in el.get(other) or [] if x != me]
            el[key] = [*(x for x in el.get(key) or [] if x != me), me]
            s["election"] = el
            await self.client.put_settings(s)
            self.note.setText(f"this node is now in election.{key}")

        self._spawn(go())

    def _spawn(self, coro: Any) -> None:
        async def guarded() -> None:
            try:
                await coro
            except (Unreachable, ApiError) as e:
                self.note.setText(str(e))

        t = asyncio.ensure_future(guarded())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)


def _ask(title: str, text: str) -> bool:
    from gui.cluster import ask

    return ask(title, text)
