"""A newly elected coordinator adopts the plan that already runs, instead of planning afresh.

Every agent's beat says which stage it serves (model, export content id, stage index and count,
layers, term) and which exports it holds whole. When a coordinator dies, its pipeline does not:
the surviving stages still hold their compiled models. :func:`adopt` (pure, table-tested) decides
from those reports which stages stay where they run and where the lost ones go, so the new
coordinator only re-assigns under its own term (the agents keep their compiled stages), moves
the dead node's layers to a node that already holds them, and serves: no export, no download
where a copy is at hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.protocol import StageReport


@dataclass(frozen=True)
class Running:
    """One live node as the election's beats show it."""

    node: str
    state: str  # available, limited, paused
    serving: StageReport | None = None
    holds: tuple[str, ...] = ()  # exports it holds whole
    score: float = 1.0


@dataclass(frozen=True)
class Held:
    """An export of the served model (with the wanted weights) that the new coordinator holds."""

    export: str
    stages: int


@dataclass(frozen=True)
class Adoption:
    model: str
    export: str  # the running export's content id
    nodes: tuple[str, ...]  # per stage, in order
    reported: tuple[tuple[int, tuple[int, int]], ...]  # (stage, layers) as the running stages report them
    kept: tuple[int, ...]  # stages that stay on the node that runs them
    moved: tuple[int, ...]  # stages whose node is gone (or paused): placed anew
    sources: tuple[str, ...]  # nodes holding the whole export (to copy it from, if needed)


def adopt(nodes: Sequence[Running], model: str, home: str | None = None, held: Sequence[Held] = ()) -> Adoption | None:
    """What to serve without exporting: the running plan of ``model`` where it can continue
    (:func:`keep_running`), else an export held here that the usable nodes can carry
    (:func:`refit`: the split for one node fewer, which the coordinator prepares in advance
    and every member copies); None when neither exists (plan and export afresh)."""
    return keep_running(nodes, model, home) or refit(nodes, model, home, held)


def refit(nodes: Sequence[Running], model: str, home: str | None, held: Sequence[Held]) -> Adoption | None:
    """Every stage placed anew on an export held here: the one with the most stages that the
    usable nodes can carry (each node one stage); stages already running it stay where they are."""
    usable = [n for n in nodes if n.state != "paused"]
    fits = [h for h in held if h.stages <= len(usable)]
    if not fits:
        return None
    h = max(fits, key=lambda x: (x.stages, x.export))
    kept: dict[int, str] = {}
    for n in usable:
        r = n.serving
        if r is not None and r.model == model and r.export == h.export and r.stages == h.stages:
            kept.setdefault(r.stage, n.node)
    return _place(nodes, model, home, h.export, h.stages, kept, {})


def keep_running(nodes: Sequence[Running], model: str, home: str | None = None) -> Adoption | None:
    """The running plan of ``model`` to adopt, or None when there is none that can continue.

    The export reported under the highest term wins. Each of its stages stays on a usable (not
    paused) node that reports it; a stage without one goes to a usable node that runs no stage
    of it: this machine's (``home``) first, then nodes holding the whole export, then the fastest.
    None when no stage of ``model`` runs, when the reports disagree on the layers, when no node
    holds the whole export (it would have to be exported again), or when too few nodes are left.
    The layers of a lost stage come from the export itself (the caller checks the reported ones
    against it).
    """
    reports = [(n, n.serving) for n in nodes if n.serving is not None and n.serving.model == model]
    if not reports:
        return None
    best = max(reports, key=lambda nr: (nr[1].term, nr[1].export))[1]
    export, count = best.export, best.stages
    ranges: dict[int, tuple[int, int]] = {}
    holder: dict[int, tuple[int, str]] = {}  # stage -> (term, node)
    for n, r in reports:
        if r.export != export or r.stages != count:
            continue
        if ranges.setdefault(r.stage, (r.start, r.end)) != (r.start, r.end):
            return None  # two nodes report one stage of one export with other layers: not to be trusted
        if n.state == "paused":
            continue
        if r.stage not in holder or (r.term, n.node) > holder[r.stage]:
            holder[r.stage] = (r.term, n.node)
    kept = {i: node for i, (_, node) in holder.items()}
    return _place(nodes, model, home, export, count, kept, ranges)


def _place(
    nodes: Sequence[Running],
    model: str,
    home: str | None,
    export: str,
    count: int,
    kept: dict[int, str],
    ranges: dict[int, tuple[int, int]],
) -> Adoption | None:
    """Stages ``kept`` stay; the others go to usable nodes not used yet: ``home`` first, then
    nodes holding the whole export, then the fastest. None when too few are left, or when no
    usable node holds the export (it would have to be exported again)."""
    usable = [n for n in nodes if n.state != "paused"]
    sources = tuple(n.node for n in usable if export in n.holds)
    if not sources:
        return None
    free = [n for n in usable if n.node not in kept.values()]
    free.sort(key=lambda n: (n.node != home, export not in n.holds, -n.score, n.node))
    moved = [i for i in range(count) if i not in kept]
    if len(moved) > len(free):
        return None
    placed = dict(kept)
    for i, n in zip(moved, free, strict=False):
        placed[i] = n.node
    return Adoption(
        model=model,
        export=export,
        nodes=tuple(placed[i] for i in range(count)),
        reported=tuple(sorted(ranges.items())),
        kept=tuple(sorted(kept)),
        moved=tuple(moved),
        sources=sources,
    )
