"""The coordinator SIGKILLed mid-answer: a pause, not an outage.

Three elected agents on loopback serve SmolLM2 (exact, so any split gives the same greedy text).
An answer streams through another agent's local API, as the tray's does. The coordinator is
killed mid-answer: the survivors elect a new one, which takes over the running plan (nothing is
exported again), the gateway goes on with the answer there, and the client's text equals the
undisturbed answer. The event stream says so.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from agent.node.capacity import probe
from coordinator.lab.local_cluster import LocalCluster
from tests.support.figures import report
from tests.support.prompts import PROMPTS
from tests.support.wait import wait_until

SERVE = ["--serve-model", "smollm2-135m", "--serve-weights", "int8", "--serve-exact", "--serve-api-port", "0"]
TOKENS = 120


def _get(port: int, path: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return dict(json.loads(r.read()))
    except OSError:
        return None


def _services(c: LocalCluster, i: int) -> dict[str, Any] | None:
    st = _get(c.api_ports[i], "/v1/cluster")
    return None if st is None else st.get("services")


def _coordinator(c: LocalCluster, among: list[int], timeout: float, ready: bool = True) -> int:
    """The agent among ``among`` that serves (and, with ``ready``, whose fallback is prepared)."""

    def serving() -> int | None:
        for i in among:
            sv = _services(c, i)
            if sv and sv["state"] == "failed":
                raise AssertionError(sv["error"])
            if sv and sv["state"] == "serving" and (not ready or len(sv["needed_exports"]) == min(len(sv["plan"]), 2)):
                return i
        return None

    got = wait_until(
        serving,
        timeout,
        what="a coordinator to serve",
        ok=lambda i: i is not None,
        step=0.5,
        diagnose=lambda: [_services(c, i) for i in among],
    )
    assert got is not None
    return got


@pytest.fixture
def cluster(tmp_path: Path, smollm2) -> Iterator[LocalCluster]:  # type: ignore[no-untyped-def]
    # three identical laptops (one speed test, copied into each home): one plan, whose exports later
    # runs find in the shared cache
    speed = tmp_path / "capacity.json"
    probe(cache_file=speed, requested="CPU")
    c = LocalCluster(
        3, elect=SERVE, names=["ann", "bob", "cid"], config="serve:\n  min_nodes: 2\n", log_dir=tmp_path, capacity=speed
    )
    with c:
        try:
            yield c
        finally:  # the agents' own logs (INFO), for when it fails
            for i in range(3):
                for f in (c.home(i) / "logs").glob("*.log"):
                    shutil.copyfile(f, tmp_path / f"home{i}-{f.name}")


async def _stream(port: int, prompt: str, on_token: Any = None) -> tuple[str, list[dict[str, Any]]]:
    """One streamed greedy answer through agent ``port``'s local API: its text and its chunks."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS, "temperature": 0, "stream": True}
    text, chunks = "", []
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(300)) as r,
    ):
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            chunks.append(obj)
            for ch in obj.get("choices", []):
                piece = ch.get("delta", {}).get("content") or ""
                text += piece
                if piece and on_token is not None:
                    on_token(text)
    return text, chunks


async def _events(port: int, into: list[dict[str, Any]], stop: threading.Event) -> None:
    async with aiohttp.ClientSession() as s, s.ws_connect(f"http://127.0.0.1:{port}/v1/cluster/events") as ws:
        while not stop.is_set():
            try:
                m = await ws.receive(timeout=0.5)
            except TimeoutError:
                continue
            if m.type != aiohttp.WSMsgType.TEXT:
                return
            into.append(json.loads(m.data))


def test_the_coordinator_killed_mid_answer_the_answer_goes_on_unchanged_and_nothing_is_exported_again(
    cluster: LocalCluster,
) -> None:
    c = cluster
    ci = _coordinator(c, [0, 1, 2], 600)
    before = _services(c, ci)
    assert before is not None
    far = next(i for i in range(3) if i != ci)
    want, _ = asyncio.run(_stream(c.api_ports[far], PROMPTS[1]))
    assert len(want) > 100

    events: list[dict[str, Any]] = []
    stop = threading.Event()
    watcher = threading.Thread(target=lambda: asyncio.run(_events(c.api_ports[far], events, stop)), daemon=True)
    watcher.start()
    # a client of the coordinator's own API (not through an agent) gets a clear error: it raises, never hangs
    direct: list[BaseException | str] = []

    def ask_directly() -> None:
        client = openai.OpenAI(base_url=before["api"], api_key="none", max_retries=0, timeout=60)
        try:
            for _ in client.chat.completions.create(
                model="smollm2-135m",
                messages=[{"role": "user", "content": PROMPTS[0]}],
                max_tokens=400,
                temperature=0,
                stream=True,
            ):
                pass
            direct.append("finished")
        except Exception as e:
            direct.append(e)

    asker = threading.Thread(target=ask_directly, daemon=True)
    asker.start()
    killed: list[float] = []
    gaps: list[float] = []
    last = [time.monotonic()]

    def on_token(text: str) -> None:
        now = time.monotonic()
        gaps.append(now - last[0])
        last[0] = now
        if not killed and len(text) > 40:
            c.kill(ci)
            killed.append(now)

    try:
        got, chunks = asyncio.run(_stream(c.api_ports[far], PROMPTS[1], on_token))
    finally:
        stop.set()
        watcher.join(10)
    assert killed, "the answer ended before the coordinator could be killed"
    assert got == want
    asker.join(30)
    assert direct and isinstance(direct[0], Exception), direct
    # one completion id, one opening chunk; the pause was said once, in a chunk without choices
    assert len({ch["id"] for ch in chunks}) == 1
    assert sum(1 for ch in chunks for x in ch["choices"] if x.get("delta", {}).get("role")) == 1
    notes = [ch["lakeshard"]["status"] for ch in chunks if not ch["choices"] and "status" in ch.get("lakeshard", {})]
    assert len(notes) == 1 and "interrupted" in notes[0]

    rest = [i for i in range(3) if i != ci]
    cj = _coordinator(c, rest, 60, ready=False)
    after = _services(c, cj)
    assert after is not None and after["term"] > before["term"]
    assert after["adopted"] is not None and after["exported"] == 0
    takeovers = [e for e in events if e["type"] == "takeover"]
    assert takeovers and takeovers[-1]["exported"] is False
    assert any(e["type"] == "coordinator_lost" for e in events)
    report(
        f"coordinator killed mid-answer: text identical, longest pause {max(gaps):.1f} s, "
        f"{after['adopted']['seconds']:.1f} s from election to serving, kept {after['adopted']['kept']}, "
        f"moved {after['adopted']['moved']}, nothing exported"
    )
