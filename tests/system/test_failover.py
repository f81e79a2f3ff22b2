"""Generation that survives losing a stage agent: re-plan over the survivors, replay, continue.

Real agent processes on loopback, killed with SIGKILL in the middle of a 200-token greedy
generation; the coordinator runs in this process. Activations, KV and wire are f32 (exact),
so a 3-stage run and its 2-stage continuation are comparable token for token.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

import pytest

from agent.common import aio
from coordinator.batching.scheduler import GenRequest
from coordinator.bench.failover import generate_with_kill
from coordinator.lab.local_cluster import LocalCluster
from coordinator.ring.pipeline import PipelineError
from coordinator.service.config import ServeConfig
from coordinator.service.coordinator import Coordinator
from tests.support.exact import exact_config
from tests.support.figures import report

TOKENS = 200
QUESTION = "Tell me a long story about a lighthouse keeper and a storm."
_terms = itertools.count(1)


def _cfg(smollm2: Any, nodes: list[str]) -> ServeConfig:
    return exact_config(smollm2, nodes, next(_terms) * 100, max_streams=2)  # type: ignore[no-any-return]


def _generate(smollm2: Any, cluster: LocalCluster, prompt: tuple[int, ...], kill: tuple[int, ...] = (), at: int = -1):  # type: ignore[no-untyped-def]
    """TOKENS greedy tokens; after token ``at``, SIGKILL the agents at ``kill``."""
    out, pause, recoveries = aio.run(
        generate_with_kill(_cfg(smollm2, cluster.nodes), cluster, prompt, TOKENS, kill, at)
    )
    return out, recoveries, pause


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    return tuple(smollm2_tokenizer.chat_ids([{"role": "user", "content": QUESTION}]))


@pytest.fixture(scope="module")
def reference(smollm2, prompt) -> list[int]:  # type: ignore[no-untyped-def]
    with LocalCluster(3) as c:
        out, rec, _ = _generate(smollm2, c, prompt)
    assert len(out) == TOKENS and rec == []
    return out


def test_killing_stage_agents_mid_generation_loses_no_text(smollm2, prompt, reference) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    cases = [
        (stage, rng.randrange(lo, hi))
        for stage, (lo, hi) in zip((1, 2, 0), ((5, 60), (60, 130), (130, 195)), strict=True)
    ]
    for stage, step in cases:
        with LocalCluster(3) as c:
            out, recoveries, pause = _generate(smollm2, c, prompt, kill=(stage,), at=step)
        assert out == reference, f"seed {seed}: killed stage {stage} after token {step}"
        assert len(recoveries) == 1 and len(recoveries[0]["nodes"]) == 2  # type: ignore[arg-type]
        report(f"failover: stage {stage} killed after token {step}: next token {pause:.2f}s later, text identical")


def test_losing_every_agent_ends_the_request_with_a_clear_error(smollm2, prompt) -> None:  # type: ignore[no-untyped-def]
    with LocalCluster(2) as c, pytest.raises(PipelineError, match="no agent is reachable") as e:
        _generate(smollm2, c, prompt, kill=(0, 1), at=10)
    assert e.value.code == "cluster_lost"


def test_a_node_joining_mid_stream_changes_the_plan_between_steps(smollm2, prompt, reference) -> None:  # type: ignore[no-untyped-def]
    """Start on two agents; a third joins at token 40 and the coordinator re-plans onto all three.
    Streams in flight move to the new plan between two steps; the text is the same."""

    async def main(c: LocalCluster) -> tuple[list[int], Coordinator]:
        coord = Coordinator(_cfg(smollm2, c.nodes[:2]))
        await coord.async_start()
        try:
            assert coord.scheduler is not None
            out: list[int] = []
            task = None
            async for tok in coord.scheduler.async_generate(GenRequest(prompt=prompt, max_tokens=TOKENS)):
                out.append(tok)
                if len(out) == 40:
                    task = asyncio.create_task(coord.async_replan(c.nodes))
            assert task is not None
            await task
            return out, coord
        finally:
            await coord.async_stop()

    with LocalCluster(3) as c:
        out, coord = aio.run(main(c))
    assert out == reference
    assert coord.nodes == c.nodes and len(coord.replans) == 1 and coord.recoveries == []
    assert coord.scheduler is not None and coord.scheduler.replays >= 1
