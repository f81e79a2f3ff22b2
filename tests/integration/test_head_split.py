"""Stage 0 computing part of a lone stream's vocabulary head (``--head-help auto``): only while
it pays. Over a slow link to stage 0 the wait for its part is longer than what it saves, so the
last stage stops asking (and re-measures now and then); the tokens are the same either way.
(The split path itself runs in every test on the ``served3`` cluster, whose agents always split.)
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from agent.common import aio
from agent.serving.stage_worker import HEAD_PROBE_EVERY, head_split_pays
from coordinator.batching.scheduler import GenRequest
from coordinator.lab.local_cluster import LocalCluster
from coordinator.service.coordinator import Coordinator
from tests.support.exact import exact_config


@pytest.mark.parametrize(
    ("rounds", "pays"),
    [
        ([], True),  # nothing measured yet: try it
        ([(0.0, 1.5)], True),  # stage 0's part came before this stage's own
        ([(0.3, 1.5), (0.2, 1.4), (0.4, 1.6)], True),  # a short wait for a larger saving
        ([(100.0, 1.5)], False),  # a 100 ms link: one round says it costs
        ([(2.0, 1.5), (2.2, 1.5), (0.1, 1.5)], False),  # typically waits longer than it saves
        ([(0.1, 1.5), (0.1, 1.5), (50.0, 1.5)], True),  # one slow round among quick ones
        ([(1.5, 1.5)], False),  # a wash: not worth the hops
    ],
)
def test_head_split_pays(rounds: list[tuple[float, float]], pays: bool) -> None:
    assert head_split_pays(rounds) is pays


def _head_steps(node: str) -> int:
    with urllib.request.urlopen(f"http://{node}/v1/node", timeout=10) as r:
        return int(json.loads(r.read())["stage"]["head_steps"])


def test_over_a_slow_link_the_last_stage_stops_splitting_the_head(smollm2, smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = tuple(smollm2_tokenizer.chat_ids([{"role": "user", "content": "Name three rivers in Europe."}]))
    tokens = HEAD_PROBE_EVERY + 8

    async def gen(nodes: list[str], term: int, delay_ms: float) -> list[int]:
        coord = Coordinator(exact_config(smollm2, nodes, term, link_delay_ms=delay_ms, failover=False))
        await coord.async_start()
        try:
            assert coord.scheduler is not None
            req = GenRequest(prompt=prompt, max_tokens=tokens)
            return [t async for t in coord.scheduler.async_generate(req)]
        finally:
            await coord.async_stop()

    with LocalCluster(2, attention="stateful") as c:  # --head-help auto, the default (stateful stages only)
        slow = aio.run(gen(c.nodes, 7100, 150.0))
        on_slow = _head_steps(c.nodes[1])
        fast = aio.run(gen(c.nodes, 7200, 0.0))
    assert len(slow) == tokens and slow == fast
    # over 150 ms hops one split round shows it costs (a split wins back a few ms of compute, even on
    # a machine so busy that its steps take ten times as long); then only a re-measuring probe
    assert 1 <= on_slow <= 1 + (tokens - 2) // HEAD_PROBE_EVERY, on_slow
