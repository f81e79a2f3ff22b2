"""What the coordinator does before it can answer, step by step, for everyone to see.

The first answer of a fresh cluster can wait minutes (pulling the model, exporting its stages,
each node downloading and compiling its own). A :class:`Preparer` holds the step now (an
:class:`~agent.protocol.cluster_view.Preparation`): the coordinator's cluster view carries it, so a
late subscriber's snapshot has it, and each new step (a step, a stage, a node's step) is
published on the event stream as it happens; its percent reaches readers through the view's
diff (every 0.25 s at most). Steps are set on the event loop; a pull or an export in a worker
thread hands its progress over through the loop (``call_soon_threadsafe``). Per node, while
the stages are assigned, each agent's ``/v1/node`` says whether it is downloading its stage's
files (how far) or compiling it; its answer to the assignment says it is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from agent.export.exporter import ExportProgress
from agent.models.download import PullProgress
from agent.protocol.cluster_view import NodeStep, Preparation
from agent.protocol.control import ID_RE
from agent.protocol.events import Event, Preparing
from agent.security.errors import SecurityError
from agent.security.transport import Transport
from agent.serving.stage_host import OPTIONAL_FILES, STAGE_FILES

log = logging.getLogger(__name__)
POLL_S = 0.25  # how often the agents being assigned are asked how far they are


class Assigning(Protocol):
    """What :meth:`Preparer.assigning` needs of a pipeline being started."""

    @property
    def placements(self) -> list[Any]: ...  # each with .node (host:port) and .stage_dir

    def replied(self, i: int) -> bool: ...


def node_key(address: str, ids: dict[str, str] | None = None) -> str:
    """The node id of the agent at ``address`` (host:port): the caller's, else one made of it."""
    known = (ids or {}).get(address)
    if known:
        return known
    key = re.sub(r"[^A-Za-z0-9_.-]", "-", address).strip("-._")[:64]
    return key if ID_RE.match(key) else "node"


class Preparer:
    def __init__(self, model: str, publish: Callable[[Event], None] | None = None) -> None:
        self.model = model
        self.publish = publish  # the event hub's publish (None: only the view carries it)
        self.current: Preparation | None = None

    # -- the steps (on the event loop) -------------------------------------------------------
    def set(
        self,
        step: str,
        *,
        stage: int | None = None,
        stages: int | None = None,
        percent: float | None = None,
        detail: str | None = None,
        error: str | None = None,
        nodes: Iterable[NodeStep] = (),
    ) -> None:
        pct = None if percent is None else round(min(max(percent, 0.0), 100.0), 1)
        new = Preparation(
            (self.model or "the model")[:300],
            step,
            stage,
            stages,
            pct,
            detail[:200] if detail else None,
            (error or "unknown error")[:2000] if step == "failed" else None,
            tuple(nodes),
        )
        old, self.current = self.current, new
        if self.publish is not None and (old is None or old.steps() != new.steps()):
            self.publish(Preparing(time.time(), new))

    def planning(self, detail: str | None = None) -> None:
        self.set("planning", detail=detail)

    def pulling(self, percent: float | None, what: str) -> None:
        self.set("pulling", percent=percent, detail=what)

    def exporting(self, i: int, n: int, fraction: float, phase: str | None, nodes: list[str]) -> None:
        """Stage ``i`` of ``n`` is ``fraction`` exported (``phase``: what it does now)."""
        waiting = [NodeStep(k, "waiting") for k in nodes]
        self.set("exporting", stage=i, stages=n, percent=100.0 * (i + fraction) / n, detail=phase, nodes=waiting)

    def ready(self) -> None:
        now = self.current
        self.set("ready", nodes=[NodeStep(n.node, "ready") for n in (now.nodes if now else ())])

    def failed(self, error: str) -> None:
        now = self.current
        nodes = [n if n.step == "ready" else NodeStep(n.node, "failed") for n in (now.nodes if now else ())]
        self.set("failed", error=error, nodes=nodes)

    # -- progress from worker threads ---------------------------------------------------------
    def pull_progress(self, loop: asyncio.AbstractEventLoop) -> PullProgress:
        """For :meth:`agent.models.store.ModelStore.resolve`, in a worker thread."""

        def report(percent: float | None, what: str) -> None:
            with contextlib.suppress(RuntimeError):  # (the loop closed: nobody waits any more)
                loop.call_soon_threadsafe(self.pulling, percent, what)

        return report

    def export_progress(
        self, loop: asyncio.AbstractEventLoop, nodes: list[str], ids: dict[str, str] | None = None
    ) -> ExportProgress:
        """For :func:`agent.export.exporter.export_model`, in a worker thread; ``nodes``: the
        agents (host:port) that wait for the stages."""
        keys = [node_key(a, ids) for a in nodes]

        def report(i: int, n: int, fraction: float, phase: str | None) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.exporting, i, n, fraction, phase, keys)

        return report

    # -- the assignment: each node downloading, compiling, ready ----------------------------
    @contextlib.asynccontextmanager
    async def assigning(
        self, pipeline: Assigning, tr: Transport, ids: dict[str, str] | None = None
    ) -> AsyncIterator[None]:
        """While ``pipeline`` assigns its stages (the body): each node's step, followed (its
        agents asked over ``tr``)."""
        task = asyncio.create_task(self._follow(pipeline, tr, ids or {}))
        try:
            yield
        except Exception as e:
            task.cancel()
            self.failed(str(e) or type(e).__name__)
            raise
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _follow(self, pipeline: Assigning, tr: Transport, ids: dict[str, str]) -> None:
        places = list(pipeline.placements)
        keys = [node_key(p.node, ids) for p in places]
        files = await asyncio.to_thread(lambda: [stage_files(p.stage_dir) for p in places])
        steps = [NodeStep(k, "waiting") for k in keys]
        async with tr.session(timeout=aiohttp.ClientTimeout(total=max(POLL_S * 4, 2.0))) as s:
            while True:
                seen = await asyncio.gather(*(_stage_status(s, tr.url(p.node, "/v1/node")) for p in places))
                steps = [
                    node_step(old, pipeline.replied(i), st, files[i])
                    for i, (old, st) in enumerate(zip(steps, seen, strict=True))
                ]
                self._assigning(steps)
                await asyncio.sleep(POLL_S)

    def _assigning(self, steps: list[NodeStep]) -> None:
        if any(n.step in ("waiting", "sending") for n in steps):
            done = [0.0 if n.step == "waiting" else (n.percent or 0.0) if n.step == "sending" else 100.0 for n in steps]
            self.set("sending", percent=sum(done) / len(done), nodes=steps)
        else:
            self.set("compiling", nodes=steps)


def node_step(old: NodeStep, replied: bool, stage: dict[str, Any] | None, files: list[tuple[str, int]]) -> NodeStep:
    """A node's step from its agent's stage status (pure): ``replied``, its assignment is answered;
    no status (no answer, an older agent that does not say), the step stays what it was."""
    if replied:
        return NodeStep(old.node, "ready")
    if stage is None:
        return old
    doing, fetching = stage.get("preparing"), stage.get("fetching")
    if doing == "compiling":
        return NodeStep(old.node, "compiling")
    if isinstance(fetching, dict):
        return NodeStep(old.node, "sending", sent_percent(files, fetching))
    if doing == "fetching":
        return NodeStep(old.node, "sending", old.percent if old.step == "sending" else 0.0)
    return old


def sent_percent(files: list[tuple[str, int]], fetching: dict[str, Any]) -> float | None:
    """How much of a stage's files (in the order agents fetch them) an agent has, given the
    file it downloads now and its bytes so far (pure; None when that file is not the stage's)."""
    name, got = fetching.get("file"), fetching.get("bytes")
    if not isinstance(got, int) or isinstance(got, bool) or got < 0:
        return None
    total = sum(size for _, size in files)
    done = 0
    for f, size in files:
        if f == name:
            return round(100.0 * (done + min(got, size)) / total, 1) if total else None
        done += size
    return None


def stage_files(stage_dir: Path) -> list[tuple[str, int]]:
    """A stage's files with their sizes, in the order its agent downloads them (see
    :meth:`agent.serving.stage_host.StageHost._artifacts`); empty when its manifest cannot be read."""
    try:
        man = stage_dir / "manifest.json"
        listed = json.loads(man.read_text())["files"]
        out = [("manifest.json", man.stat().st_size)]
        out += [(f, int(listed[f]["size"])) for f in (*STAGE_FILES, *OPTIONAL_FILES) if f in listed]
        return out
    except (OSError, ValueError, KeyError, TypeError):
        return []


async def _stage_status(s: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    """The stage part of an agent's ``/v1/node`` (a daemon's ``stage``, a bare agent's whole answer)."""
    try:
        async with s.get(url) as r:
            if r.status != 200:
                return None
            d = await r.json()
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError, SecurityError):
        return None
    if not isinstance(d, dict):
        return None
    st = d.get("stage")
    return st if isinstance(st, dict) else d
