"""Continuous batching (issue 39): the coordinator runs many streams per stage step on paged agents.

Real agent processes started ``--attention paged``, a real coordinator (its micro-batching
scheduler, :class:`coordinator.batching.batcher.Batcher`), SmolLM2 INT8 with f32 activations,
wire and KV (``exact_config``), so that every comparison is token for token.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from agent.common import aio
from agent.protocol.data import SamplingSpec
from coordinator.batching.batcher import Batcher
from coordinator.batching.scheduler import GenRequest
from coordinator.lab.local_cluster import LocalCluster
from coordinator.ring.pipeline import PipelineError
from coordinator.service.coordinator import Coordinator
from coordinator.speculative.decoding import SpecCounters
from tests.support.exact import exact_config
from tests.support.figures import report
from tests.support.wait import async_wait_until

TEXTS = [
    "What is the capital of France? Tell me about the city.",
    "Hi",
    "Explain photosynthesis to a ten year old in simple words, please, with an example from a garden.",
    "Why is the sky blue?",
    "Write a haiku about laptops that share their work at night.",
    "List three prime numbers.",
    "How do I sort a list in Python? Show a short example and explain the key argument.",
    "Say hello in French.",
]
TOKENS = 16
SAMPLED = SamplingSpec(0.8, 0.95, 7)
_terms = iter(range(200, 10_000))


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any) -> list[tuple[int, ...]]:
    return [tuple(map(int, smollm2_tokenizer.chat_ids([{"role": "user", "content": t}]))) for t in TEXTS]


@pytest.fixture(scope="module")
def ring2() -> Iterator[LocalCluster]:
    with LocalCluster(2, threads=1, attention="paged") as c:
        yield c


@pytest.fixture(scope="module")
def small_pool() -> Iterator[LocalCluster]:
    """One paged agent whose KV pool holds 12 blocks (a few streams at a time)."""
    with LocalCluster(1, threads=1, attention="paged", env={"LAKESHARD_KV_BLOCKS": "12"}) as c:
        yield c


def _node(node: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{node}/v1/node", timeout=10) as r:
        return dict(json.loads(r.read()))


def _sampling(i: int) -> SamplingSpec:
    return SAMPLED if i % 4 == 3 else SamplingSpec()


async def _with_coordinator(model: Any, nodes: list[str], job: Any, **kw: Any) -> Any:
    kw.setdefault("failover", False)
    coord = Coordinator(exact_config(model, nodes, next(_terms), **kw))
    await coord.async_start()
    try:
        assert isinstance(coord.scheduler, Batcher), "paged agents: the coordinator batches"
        return await job(coord.scheduler)
    finally:
        await coord.async_stop()


async def _one(b: Batcher, prompt: tuple[int, ...], i: int, delay: float = 0.0) -> list[int]:
    await asyncio.sleep(delay)
    req = GenRequest(prompt=prompt, max_tokens=TOKENS + i % 3 * 4, sampling=_sampling(i))
    return [t async for t in b.async_generate(req)]


@pytest.mark.parametrize("stages", [1, 2])
def test_every_stream_gets_its_solo_tokens_batched_with_others_that_come_and_go(
    ring2: LocalCluster, smollm2: Any, prompts: list[tuple[int, ...]], stages: int
) -> None:
    """8 streams of different prompt lengths and answer lengths, greedy and seeded, joining at
    random moments while others decode, on 1 and 2 stages: each one's tokens are those it gets
    alone, the stages computed many streams per step, and every KV block is free afterwards."""
    nodes = ring2.nodes[:stages]
    delays = [random.Random(stages * 100 + i).uniform(0.0, 1.5) for i in range(len(prompts))]

    async def alone(b: Batcher) -> list[list[int]]:
        return [await _one(b, p, i) for i, p in enumerate(prompts)]

    async def together(b: Batcher) -> tuple[list[list[int]], float]:
        out = await asyncio.gather(*[_one(b, p, i, delays[i]) for i, p in enumerate(prompts)])
        return list(out), b.parts_sent / max(1, b.batches_sent)

    solo = aio.run(_with_coordinator(smollm2, nodes, alone))
    batched, parts_per_batch = aio.run(_with_coordinator(smollm2, nodes, together))
    assert batched == solo
    assert all(len(t) > 0 for t in solo)
    assert parts_per_batch > 1.5, "streams shared stage steps"

    async def pools_full() -> bool:
        stages_now = [_node(n)["stage"] for n in nodes]
        return all(s["kv_blocks_free"] == s["kv_blocks_total"] for s in stages_now)

    aio.run(async_wait_until(pools_full, timeout=10, what="every stage's KV blocks free again"))


def test_speculative_streams_in_a_batch_give_the_plain_tokens(
    ring2: LocalCluster, smollm2: Any, prompts: list[tuple[int, ...]]
) -> None:
    """6 streams batched on 2 paged stages with a draft model: each decode part verifies up to
    K drafts (K+1 rows) beside the other streams' parts, rejected drafts are rolled back, and every
    stream's tokens are those it gets decoding plainly in the same batch."""
    counters = SpecCounters()
    jobs = list(enumerate(prompts[:6]))

    async def run(b: Batcher, k: int) -> list[list[int]]:
        async def one(i: int, p: tuple[int, ...]) -> list[int]:
            req = GenRequest(
                p, max_tokens=TOKENS, sampling=_sampling(i), spec_k=k, spec_counters=counters if k else None
            )
            return [t async for t in b.async_generate(req)]

        return list(await asyncio.gather(*[one(i, p) for i, p in jobs]))

    async def both(b: Batcher) -> tuple[list[list[int]], list[list[int]]]:
        assert b.drafter is not None
        return await run(b, 0), await run(b, 4)

    plain, spec = aio.run(_with_coordinator(smollm2, ring2.nodes, both, draft="smollm2-135m", draft_weights="int4"))
    assert spec == plain
    assert counters.rounds > 0 and 0 < counters.accepted < counters.proposed  # drafts kept and rolled back


def test_a_pool_too_small_for_everyone_makes_streams_wait_and_each_still_gets_its_tokens(
    small_pool: LocalCluster, smollm2: Any, prompts: list[tuple[int, ...]]
) -> None:
    """12 KV blocks of 32 tokens cannot hold 8 streams at once: some wait (or are preempted and
    recomputed) and every answer is still the one it gets alone; the pool is full again after."""
    nodes = small_pool.nodes

    async def alone(b: Batcher) -> list[list[int]]:
        return [await _one(b, p, i) for i, p in enumerate(prompts)]

    async def together(b: Batcher) -> tuple[list[list[int]], int]:
        most_waiting = 0

        async def watch() -> None:
            nonlocal most_waiting
            while True:
                most_waiting = max(most_waiting, b.waiting)
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        out = await asyncio.gather(*[_one(b, p, i) for i, p in enumerate(prompts)])
        watcher.cancel()
        return list(out), most_waiting

    solo = aio.run(_with_coordinator(smollm2, nodes, alone))
    batched, most_waiting = aio.run(_with_coordinator(smollm2, nodes, together))
    assert batched == solo
    assert most_waiting > 0, "some streams waited for blocks"
    stage = _node(nodes[0])["stage"]
    assert stage["kv_blocks_total"] == 12

    async def pool_full() -> bool:
        s = _node(nodes[0])["stage"]
        return bool(s["kv_blocks_free"] == s["kv_blocks_total"])

    aio.run(async_wait_until(pool_full, timeout=10, what="the pool full again"))


def test_a_full_admission_queue_is_refused_with_a_retry_time(
    small_pool: LocalCluster, smollm2: Any, prompts: list[tuple[int, ...]]
) -> None:
    """Past the admission queue's limit a request is refused at once with how long to wait
    (the API's 503 and Retry-After); the requests admitted finish."""

    async def job(b: Batcher) -> tuple[list[list[int]], PipelineError]:
        b.queue_limit, b.max_streams = 1, 1
        first = asyncio.create_task(_one(b, prompts[0], 0))
        await async_wait_until(lambda: b.active == 1, timeout=10, what="the first request running")
        second = asyncio.create_task(_one(b, prompts[1], 1))
        await async_wait_until(lambda: b.waiting == 1, timeout=10, what="the second request queued")
        with pytest.raises(PipelineError) as refused:
            await _one(b, prompts[2], 2)
        return [await first, await second], refused.value

    done, err = aio.run(_with_coordinator(smollm2, small_pool.nodes, job))
    assert all(len(t) > 0 for t in done)
    assert err.code == "overloaded" and err.retry_after is not None and err.retry_after >= 1


def test_a_stage_killed_mid_batch_loses_and_repeats_no_token(smollm2: Any, prompts: list[tuple[int, ...]]) -> None:
    """6 streams batched over 3 paged agents; one agent is killed while they decode. The
    coordinator re-plans over the other two and recomputes every stream from its tokens so far:
    each text equals the undisturbed run's, with no token lost or repeated."""
    with LocalCluster(3, threads=1, attention="paged") as cluster:
        jobs = list(enumerate(prompts[:6]))

        async def undisturbed(b: Batcher) -> list[list[int]]:
            return list(await asyncio.gather(*[_one(b, p, i) for i, p in jobs]))

        async def killed(b: Batcher) -> tuple[list[list[int]], int]:
            runs = [asyncio.create_task(_one(b, p, i)) for i, p in jobs]
            await async_wait_until(lambda: b.tokens_out >= 12, timeout=60, what="the streams decoding")
            await asyncio.to_thread(cluster.kill, 2)
            return list(await asyncio.gather(*runs)), b.replays

        want = aio.run(_with_coordinator(smollm2, cluster.nodes, undisturbed))
        got, replays = aio.run(_with_coordinator(smollm2, cluster.nodes, killed, failover=True))
    assert got == want
    assert replays > 0, "the streams were recomputed on the re-planned ring"


def test_the_api_answers_503_with_retry_after_when_the_admission_queue_is_full() -> None:
    """``lakeshard serve`` on a paged agent, one stream batched at a time and no place in the
    queue: while a streamed chat is being answered, another gets 503 with a Retry-After header
    at once; the first one is answered to its end."""
    from tests.support.served import Served

    served = Served(1, "--batch-streams", "1", "--batch-queue", "0", agent_args=["--attention", "paged"])
    url = f"{served.api_url}/v1/chat/completions"

    def request(text: str, stream: bool) -> urllib.request.Request:
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": text}], "max_tokens": 24}
        body["stream"] = stream
        return urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})

    try:
        with urllib.request.urlopen(request(TEXTS[0], True), timeout=120) as first:
            assert first.readline().startswith(b"data: ")  # its first chunk: it holds the one place
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request(TEXTS[1], False), timeout=60)
            rest = first.read().decode()
    finally:
        served.stop()
    assert refused.value.code == 503 and int(refused.value.headers["Retry-After"]) >= 1
    assert json.loads(refused.value.read())["error"]["code"] == "overloaded"
    assert rest.rstrip().endswith("data: [DONE]")


SYSTEM = (
    "You are the office assistant of a small architecture firm. You answer in short, plain sentences, "
    "you never invent facts about projects you were not told about, and when a question is about "
    "building codes you say which code and which section you mean. You may use lists."
)


def test_a_shared_prompt_head_is_computed_once_and_changes_no_answer(
    ring2: LocalCluster, smollm2: Any, smollm2_tokenizer: Any
) -> None:
    """Chats that begin with the same system prompt, one after another and then together: with
    the prefix cache, later ones share the first one's KV blocks of that head instead of
    computing them, and every answer is the one computed without the cache."""
    questions = ["What is a load-bearing wall?", "Name two roof shapes.", "Why insulate a roof?", "What is a lintel?"]
    chats = [
        tuple(
            map(
                int, smollm2_tokenizer.chat_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            )
        )
        for q in questions
    ]
    assert len(chats[0]) > 64  # two whole blocks of head at least

    async def job(b: Batcher) -> tuple[list[list[int]], list[list[int]], float]:
        one_by_one = [await _one(b, p, 0) for p in chats]
        together = list(await asyncio.gather(*[_one(b, p, 0) for p in chats]))
        return one_by_one, together, b.prefix.hit_rate if b.prefix is not None else 0.0

    cached_seq, cached_par, hit_rate = aio.run(_with_coordinator(smollm2, ring2.nodes, job))
    plain_seq, plain_par, none = aio.run(_with_coordinator(smollm2, ring2.nodes, job, prefix_cache=False))
    assert cached_seq == plain_seq and cached_par == plain_par == plain_seq
    assert none == 0.0 and hit_rate > 0.5, "most prompt tokens came from cached heads"


def test_stages_time_their_steps_by_batch_size_and_the_coordinator_keeps_the_curve(
    ring2: LocalCluster, smollm2: Any, prompts: list[tuple[int, ...]], tmp_path: Any
) -> None:
    """A paged stage reports its median step time per batch size; the coordinator fits the
    batch curve the planner uses (a step of many rows against one row) and stores it for this
    model and weights."""
    from coordinator.planning.calibration import CalibrationStore

    async def main() -> Any:
        coord = Coordinator(exact_config(smollm2, ring2.nodes[:1], next(_terms), failover=False))
        coord.calibration = CalibrationStore(tmp_path / "calibration.json")
        await coord.async_start()
        try:
            b = coord.scheduler
            assert isinstance(b, Batcher)
            for p in prompts[:2]:  # one row a step
                await _one(b, p, 0)
            for users in (4, 8):  # about that many rows a step
                await asyncio.gather(*[_one(b, p, 0) for p in prompts[:users]])
            return await coord.rebalancer.async_batch_curve(), coord.cfg.calib_key
        finally:
            await coord.async_stop()

    curve, key = aio.run(main())
    rows = _node(ring2.nodes[0])["stage"]["step_ms_by_rows"]
    assert {"1", "4", "8"} <= set(rows), rows
    assert curve is not None and curve[0] == (1, 1.0), curve
    assert all(g0 <= g1 for (_, g0), (_, g1) in itertools.pairwise(curve)), curve
    assert CalibrationStore(tmp_path / "calibration.json").curve(key) == curve
    report(f"batch curve of a SmolLM2 stage (rows, step time against one row's): {curve}")
