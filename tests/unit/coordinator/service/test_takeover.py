"""A new coordinator adopts the running plan (coordinator/service/takeover.py): table-driven, no network."""

from __future__ import annotations

import pytest

from agent.protocol import StageReport
from coordinator.service.takeover import Held, Running, adopt

E1 = "a" * 32  # the running export (3 stages)
E2 = "b" * 32  # the split for one node fewer (2 stages)
M = "smollm2-135m"


def rep(stage: int, stages: int = 3, export: str = E1, term: int = 4, model: str = M) -> StageReport:
    layers = {3: [(0, 10), (10, 20), (20, 30)], 2: [(0, 15), (15, 30)], 1: [(0, 30)]}[stages]
    a, b = layers[stage]
    return StageReport(model, export, stage, stages, a, b, term)


def node(name: str, serving: StageReport | None = None, holds: tuple[str, ...] = (E1,), **kw: object) -> Running:
    return Running(name, str(kw.get("state", "available")), serving, holds, float(kw.get("score", 1.0)))  # type: ignore[arg-type]


CASES = [
    pytest.param(
        # the coordinator (stage 0) died; an idle node that holds the export takes its layers
        [node("b", rep(1)), node("c", rep(2)), node("d")],
        "b",
        [],
        ("a" * 32, ("d", "b", "c"), (1, 2), (0,)),
        id="lost-stage-0-to-idle-holder",
    ),
    pytest.param(
        # the new coordinator itself serves nothing: it takes the lost stage (no hop to stage 0)
        [node("b"), node("c", rep(1)), node("d", rep(2))],
        "b",
        [],
        (E1, ("b", "c", "d"), (1, 2), (0,)),
        id="home-first",
    ),
    pytest.param(
        # of two idle nodes, the one holding the whole export is preferred over the faster one
        [node("b", rep(1)), node("c", rep(2)), node("x", holds=(), score=9.0), node("y")],
        None,
        [],
        (E1, ("y", "b", "c"), (1, 2), (0,)),
        id="holder-before-faster",
    ),
    pytest.param(
        # nothing was lost (the coordinator ran no stage): every stage stays
        [node("b", rep(0)), node("c", rep(1)), node("d", rep(2))],
        "b",
        [],
        (E1, ("b", "c", "d"), (0, 1, 2), ()),
        id="all-kept",
    ),
    pytest.param(
        # a paused stage node hands its stage over too
        [node("b", rep(0)), node("c", rep(1), state="paused"), node("d", rep(2)), node("e")],
        "b",
        [],
        (E1, ("b", "e", "d"), (0, 2), (1,)),
        id="paused-holder-moves",
    ),
    pytest.param(
        # every node is in the plan: the lost stage cannot move, so the held 2-stage split is refit
        [node("b", rep(1), holds=(E1, E2)), node("c", rep(2), holds=(E1, E2))],
        "b",
        [Held(E2, 2)],
        (E2, ("b", "c"), (), (0, 1)),
        id="refit-one-node-fewer",
    ),
    pytest.param(
        # the one-stage plan's node (the coordinator) died: its export, held here, goes home
        [node("b"), node("c")],
        "b",
        [Held(E1, 1)],
        (E1, ("b",), (), (0,)),
        id="refit-single-stage",
    ),
    pytest.param(
        # reports of an older term (a plan replaced since) lose to the newest
        [node("b", rep(0, term=2, export="c" * 32)), node("c", rep(1)), node("d", rep(2)), node("e")],
        "b",
        [],
        (E1, ("b", "c", "d"), (1, 2), (0,)),
        id="newest-term-wins",
    ),
]


@pytest.mark.parametrize(("nodes", "home", "held", "want"), CASES)
def test_the_new_coordinator_keeps_what_runs_and_moves_only_what_was_lost(
    nodes: list[Running],
    home: str | None,
    held: list[Held],
    want: tuple[str, tuple[str, ...], tuple[int, ...], tuple[int, ...]],
) -> None:
    a = adopt(nodes, M, home, held)
    assert a is not None
    assert (a.export, a.nodes, a.kept, a.moved) == want


NONE_CASES = [
    pytest.param([node("b"), node("c")], [], id="nothing-runs-and-nothing-needed"),
    pytest.param([node("b", rep(1, model="other")), node("c")], [], id="another-model-runs"),
    pytest.param(
        [node("b", rep(1), holds=()), node("c", rep(2), holds=()), node("d", holds=())], [], id="nobody-holds-it"
    ),
    pytest.param([node("b", rep(1)), node("c", rep(2))], [], id="too-few-nodes-and-no-refit"),
    pytest.param([node("b", rep(1)), node("c", rep(2))], [Held(E2, 3)], id="refit-needs-more-nodes"),
    pytest.param(
        [node("b", rep(1)), node("c", StageReport(M, E1, 1, 3, 10, 21, 4)), node("d")], [], id="reports-disagree"
    ),
]


@pytest.mark.parametrize(("nodes", "held"), NONE_CASES)
def test_without_a_plan_to_continue_the_coordinator_plans_afresh(nodes: list[Running], held: list[Held]) -> None:
    assert adopt(nodes, M, "b", held) is None
