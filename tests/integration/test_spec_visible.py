"""Speculation made visible: what each answer drafted and kept, in the response and the event stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from agent.common import aio
from tests.support.served import Served

# A prompt whose answer repeats what it was given: prompt lookup finds drafts in it.
PROMPT = (
    "Copy this list exactly, one item per line: red apple, green pear, yellow banana, "
    "purple plum, orange orange, red apple, green pear, yellow banana, purple plum."
)


@pytest.fixture(scope="module")
def served_lookup(smollm2) -> Iterator[Served]:  # type: ignore[no-untyped-def]
    s = Served(2, "--model", "smollm2-135m", "--weights", "int8", "--exact", "--draft", "lookup", "--spec-k", "3")
    yield s
    s.stop()


async def _answer_and_its_event(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{url}/v1/cluster/events") as ws:
        snapshot = json.loads((await ws.receive()).data)
        assert snapshot["type"] == "snapshot"
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            answer: dict[str, Any] = await r.json()
        while True:
            ev = json.loads((await asyncio.wait_for(ws.receive(), 30)).data)
            if ev["type"] == "stream_finished" and ev["stream"] == answer["id"]:
                return answer, ev


def test_each_answer_reports_what_it_drafted_and_kept(served_lookup: Served) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 64, "temperature": 0}
    answer, event = aio.run(_answer_and_its_event(served_lookup.api_url, body))
    spec = answer["lakeshard"]["speculation"]
    assert spec is not None, answer["lakeshard"]
    assert spec["rounds"] > 0 and spec["drafted"] >= spec["rounds"]
    assert 0 < spec["accepted"] <= spec["drafted"]  # the list repeats: some drafts are kept
    assert spec["acceptance"] == round(spec["accepted"] / spec["drafted"], 3)
    assert spec["mean_k"] <= 3  # --spec-k 3
    assert (event["drafted"], event["accepted"]) == (spec["drafted"], spec["accepted"])
    assert answer["usage"]["completion_tokens"] == answer["lakeshard"]["completion_tokens"]


def test_an_answer_decoded_plainly_reports_no_speculation(served3: Served) -> None:
    """served3 has no draft: its answers carry speculation None, its events zero drafts."""
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
    answer, event = aio.run(_answer_and_its_event(served3.api_url, body))
    assert answer["lakeshard"]["speculation"] is None
    assert event["drafted"] == 0 and event["accepted"] == 0
