"""A steady node map (issue 40, item 3): boxes keep their places across re-plans, the ring's
round-trip labels never overlap (checked geometrically), a legend says what each colour and icon
means, and the log never writes a plan holding a paused or dead node. Pure parts table-driven,
then the window driven with events, offscreen."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest
from PySide6.QtCore import QLineF, QPointF, QRectF

from agent.protocol.cluster_view import ClusterView, NodeInfo
from agent.protocol.events import NodeChanged, NodeLeft, PlanChanged, Snapshot, apply_event
from gui.nodemap import LEGEND, NodeMapWindow, label_rects, layout, node_icon_state, plan_line, stable_order
from gui.state import TrayState

NAMES = {"ann": "ann-laptop", "bob": "bob-laptop", "carol": "carol-laptop", "dan": "dan-laptop"}


def _node(node: str, state: str = "available", **kw: object) -> NodeInfo:
    return NodeInfo(node, NAMES.get(node, node), f"10.0.0.{len(node)}:7700", "follower", state, **kw)  # type: ignore[arg-type]


def _view(ring: tuple[str, ...], nodes: tuple[NodeInfo, ...] | None = None, service: str = "serving") -> ClusterView:
    nodes = nodes or tuple(_node(n, next_rtt_ms=0.42) for n in sorted(NAMES))
    return ClusterView("office", "ann", 3, "smollm2-135m", service, ring=ring, nodes=nodes)


@pytest.mark.parametrize(
    ("before", "nodes", "after"),
    [
        ([], ("carol", "ann", "bob"), ["ann", "bob", "carol"]),  # newcomers by id
        (["carol", "ann", "bob"], ("ann", "bob", "carol"), ["carol", "ann", "bob"]),  # kept as placed
        (["carol", "ann", "bob"], ("ann", "carol"), ["carol", "ann"]),  # one left: the others keep their order
        (["carol", "ann"], ("ann", "bob", "carol", "dan"), ["carol", "ann", "bob", "dan"]),  # joiners after
    ],
)
def test_places_go_by_node_in_the_order_they_came(before: list[str], nodes: tuple[str, ...], after: list[str]) -> None:
    assert stable_order(before, _view((), tuple(_node(n) for n in nodes))) == after


def test_a_replan_moves_no_box() -> None:
    v1, v2 = _view(("ann", "bob", "carol")), _view(("carol", "dan", "bob", "ann"))
    order = stable_order([], v1)
    assert stable_order(order, v2) == order
    assert layout(v1, 900, 600, order) == layout(v2, 900, 600, stable_order(order, v2))


def _centres(k: int, w: float, h: float, seed: int) -> dict[str, QPointF]:
    nodes = tuple(_node(f"n{i}") for i in range(k))
    order = [n.node for n in nodes]
    random.Random(seed).shuffle(order)
    return {n: r.center() for n, r in layout(_view((), nodes), w, h, order).items()}


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("size", [(520, 420), (760, 540), (1180, 720)])
def test_link_labels_never_overlap(k: int, size: tuple[int, int]) -> None:
    """Every ring order over the boxes (a re-plan may take any), labels as wide as '1234 ms' and
    wider: no two labels overlap, and none lies across its own link."""
    rng = random.Random(k * 1000 + size[0])
    for seed in range(6):
        centres = _centres(k, *size, seed)
        nodes = sorted(centres)
        rings = list(itertools.permutations(nodes)) if k <= 4 else [tuple(rng.sample(nodes, k)) for _ in range(40)]
        for ring in rings:
            sizes = {n: (rng.uniform(40, 90), rng.uniform(14, 22)) for n in ring}
            rects = label_rects(centres, list(ring), sizes)
            assert set(rects) == set(ring)
            for (a, ra), (b, rb) in itertools.combinations(rects.items(), 2):
                assert not ra.intersects(rb), (ring, a, ra, b, rb)
            for i, n in enumerate(ring):
                link = QLineF(centres[n], centres[ring[(i + 1) % k]])
                assert not _crosses(rects[n], link), (ring, n, rects[n])


def _crosses(r: QRectF, line: QLineF) -> bool:
    edges = [
        QLineF(r.topLeft(), r.topRight()),
        QLineF(r.topRight(), r.bottomRight()),
        QLineF(r.bottomRight(), r.bottomLeft()),
        QLineF(r.bottomLeft(), r.topLeft()),
    ]
    hit = any(e.intersects(line)[0] == QLineF.IntersectionType.BoundedIntersection for e in edges)
    return hit or r.contains(line.center())


@pytest.fixture
def window(qapp) -> Iterator[NodeMapWindow]:  # type: ignore[no-untyped-def]
    w = NodeMapWindow(None)  # type: ignore[arg-type]  # (no actions taken: no client needed)
    w.resize(1080, 700)
    w.canvas.resize(760, 540)
    yield w
    w.close()


def test_map_positions_unchanged_across_a_replan(window: NodeMapWindow) -> None:
    v = _view(("ann", "bob", "carol"))
    window.on_event((Snapshot(1.0, v), v))
    before = window.canvas.boxes()
    assert set(before) == set(NAMES)
    ev = PlanChanged(2.0, ("carol", "dan", "ann"), ((0, 10), (10, 20), (20, 30)), "smollm2-135m", "serving", 3)
    v2 = apply_event(v, ev)
    window.on_event((ev, v2))
    assert window.canvas.boxes() == before
    # the two labels of a two-node ring (one link each way, on the same line) stand apart
    ev = PlanChanged(3.0, ("ann", "bob"), ((0, 15), (15, 30)), "smollm2-135m", "serving", 3)
    window.on_event((ev, apply_event(v2, ev)))
    labels = window.canvas.labels()
    assert set(labels) == {"ann", "bob"}
    assert not labels["ann"][1].intersects(labels["bob"][1])
    window.canvas.grab()  # it paints


@pytest.mark.parametrize(
    ("ring", "states", "service", "line"),
    [
        (("ann", "bob"), {}, "serving", "plan (serving): ann-laptop [0-14] → bob-laptop [15-29]"),
        (("bob",), {"bob": "paused"}, "re-planning", "re-planning… (bob-laptop paused)"),
        (("bob",), {"bob": "gone"}, "serving", "serving: waiting for a plan without bob-laptop left"),
        (("bob",), {"bob": "paused"}, "serving", "serving: waiting for a plan without bob-laptop paused"),
        (("ann", "bob"), {}, "re-planning", "re-planning…"),
        (("ann",), {"ann": "limited"}, "assigning", "plan (assigning): ann-laptop [0-29]"),  # limited still serves
    ],
)
def test_the_log_writes_no_plan_with_a_paused_or_dead_node(
    ring: tuple[str, ...], states: dict[str, str], service: str, line: str
) -> None:
    nodes = tuple(_node(n, states.get(n, "available")) for n in sorted(NAMES) if states.get(n) != "gone")
    layers = ((0, 15), (15, 30)) if len(ring) == 2 else ((0, 30),)
    ev = PlanChanged(1.0, ring, layers, "smollm2-135m", service, 3)
    assert plan_line(ev, _view(ring, nodes, service), NAMES) == line


def test_the_issues_log_lines_do_not_come_back(window: NodeMapWindow) -> None:
    """bob pauses, then dies, while the coordinator's view still holds the ring with him."""
    v = _view(("bob",))
    window.on_event((Snapshot(1.0, v), v))
    for ev in (
        NodeChanged(2.0, _node("bob", "paused", reason="user"), ("state",)),
        PlanChanged(2.0, ("bob",), ((0, 30),), "smollm2-135m", "re-planning", 3),
        NodeLeft(3.0, "bob", "bob-laptop"),
        PlanChanged(3.0, ("bob",), ((0, 30),), "smollm2-135m", "serving", 3),
    ):
        v = apply_event(v, ev)  # type: ignore[assignment]
        window.on_event((ev, v))
    assert not any("bob-laptop [0-29]" in line for line in window.log_lines), window.log_lines
    assert any("bob-laptop paused" in line for line in window.log_lines)


def test_the_legend_names_every_state_a_node_shows(window: NodeMapWindow) -> None:
    shown = {
        node_icon_state(n, c)
        for n, c in [
            (_node("a"), False),
            (_node("a"), True),
            (_node("a", tok_s=5.0, layers=(0, 10)), False),
            (_node("a", "limited", reason="user active"), False),
            (_node("a", "paused", reason="user"), False),
            (_node("a", "paused", reason="92 C"), False),
        ]
    }
    legend = {s for s, _ in LEGEND}
    assert (
        shown
        == legend
        == {
            TrayState.AVAILABLE,
            TrayState.COORDINATOR,
            TrayState.SERVING,
            TrayState.LIMITED,
            TrayState.PAUSED_USER,
            TrayState.PAUSED_HEAT,
        }
    )
    assert set(window.legend.entries) == legend
    assert window.legend.entries[TrayState.PAUSED_HEAT].text() == "paused (heat or battery)"
