"""The node map's layout (pure): every box inside the window and below the header line; at the
window's usual sizes, none on another (shrunk to its 520 x 420 minimum, three or four boxes of
236 x 132 cannot all stand apart)."""

from __future__ import annotations

import itertools

import pytest

from agent.protocol.cluster_view import ClusterView, NodeInfo
from gui.nodemap import HEADER_H, layout


def _view(k: int) -> ClusterView:
    nodes = tuple(NodeInfo(f"n{i}", f"laptop-{i}", f"127.0.0.1:{7700 + i}", "follower", "available") for i in range(k))
    return ClusterView("office", "n0", 1, "smollm2-135m", "serving", nodes=nodes, ring=tuple(n.node for n in nodes))


@pytest.mark.parametrize(("k", "size"), [(k, s) for k in (1, 2, 3, 4) for s in ((520, 420), (840, 540), (1180, 720))])
def test_boxes_sit_below_the_header_inside_the_window_and_apart(k: int, size: tuple[int, int]) -> None:
    w, h = size
    boxes = layout(_view(k), w, h)
    assert len(boxes) == k
    for r in boxes.values():
        assert r.top() >= HEADER_H and r.bottom() <= h and r.left() >= 0 and r.right() <= w, (r, size)
    if w >= 840:
        for a, b in itertools.combinations(boxes.values(), 2):
            assert not a.intersects(b), (a, b, size)
