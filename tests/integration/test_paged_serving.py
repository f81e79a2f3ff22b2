"""Agents started paged (``--attention paged``) serve micro-batches and today's Fwd frames.

Real agent processes, real sockets: most tests assign the stages themselves, as a coordinator
does (:class:`tests.support.ring.Ring`), and receive the last stage's answers on a websocket
server of their own, so they send exactly the frames they mean to. SmolLM2 INT8 in 2 stages,
f32 activations and wire, f32 KV (the exact compile properties, as ``exact_config``)."""

from __future__ import annotations

import asyncio
import itertools
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from agent.common import aio
from agent.protocol import Batch, Close, Error, Message, Part, decode, encode
from agent.protocol.data import SamplingSpec
from agent.runtime.paged import PagedStage
from agent.serving.paged_worker import PagedWorker
from coordinator.batching.batcher import Batcher
from coordinator.batching.scheduler import GenRequest
from coordinator.lab.local_cluster import LocalCluster
from coordinator.service.coordinator import Coordinator
from coordinator.speculative.decoding import SpecCounters
from tests.support.exact import exact_config
from tests.support.ring import Ring

TEXTS = [
    "What is the capital of France? Tell me about the city.",
    "Hi",
    "Explain photosynthesis to a ten year old in simple words, please, with an example from a garden.",
    "Why is the sky blue?",
]
TOKENS = 12
BUDGET = 512  # the paged agents' step budget (LAKESHARD_STEP_TOKENS)
GREEDY, SAMPLED = SamplingSpec(), SamplingSpec(0.8, 0.95, 5)
SAMPLING = [GREEDY, GREEDY, GREEDY, SAMPLED]  # the last stream samples, seeded
_terms = itertools.count(100)  # every assignment a newer term than any an agent has seen


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any) -> list[list[int]]:
    ids = [list(map(int, smollm2_tokenizer.chat_ids([{"role": "user", "content": t}]))) for t in TEXTS]
    assert len({len(p) for p in ids}) == len(ids) and sum(map(len, ids)) < BUDGET
    return ids


@pytest.fixture(scope="module")
def export(smollm2: Any) -> Path:
    from agent.export.exporter import ExportOptions, export_model

    return export_model(smollm2, [(0, 11), (11, 30)], ExportOptions(weights="int8"), quiet=True).dir


@pytest.fixture(scope="module")
def paged() -> Iterator[LocalCluster]:
    with LocalCluster(2, threads=1, attention="paged", env={"LAKESHARD_STEP_TOKENS": str(BUDGET)}) as c:
        yield c


@pytest.fixture(scope="module")
def stateful() -> Iterator[LocalCluster]:
    with LocalCluster(2, threads=1, attention="stateful") as c:
        yield c


def _stage(node: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{node}/v1/node", timeout=10) as r:
        return dict(json.loads(r.read())["stage"])


def _alone(cluster: LocalCluster, export: Path, prompts: list[list[int]]) -> list[list[int]]:
    async def go() -> list[list[int]]:
        async with Ring(cluster.nodes, export, next(_terms)) as ring:
            return [await ring.alone(f"solo{i}", p, SAMPLING[i], TOKENS) for i, p in enumerate(prompts)]

    return aio.run(go())


@pytest.fixture(scope="module")
def solo_paged(paged: LocalCluster, export: Path, prompts: list[list[int]]) -> list[list[int]]:
    return _alone(paged, export, prompts)


async def _batched(ring: Ring, prompts: list[list[int]]) -> list[list[int]]:
    """Every stream in one micro-batch a step: the prompts (the third one in two chunks, its
    first asking for no token), then decode steps, each stream until it has its tokens."""
    names = [f"s{i}" for i in range(len(prompts))]
    toks: list[list[int]] = [[] for _ in prompts]
    cut = len(prompts[2]) // 2
    first = []
    for i, p in enumerate(prompts):
        ids = p[:cut] if i == 2 else p
        first.append((Part(names[i], 0, len(ids), start=True, logits=int(i != 2), sampling=SAMPLING[i]), ids))
    got = await ring.batch(0, first)
    assert names[2] not in got  # a prefill chunk that is not the prompt's end gives no token
    for i, t in enumerate(toks):
        t += got.get(names[i], ())
    seq = 1
    while any(len(t) < TOKENS for t in toks):
        parts = []
        for i, t in enumerate(toks):
            if len(t) >= TOKENS:
                continue
            ids = prompts[2][cut:] if not t else [t[-1]]
            parts.append((Part(names[i], seq, len(ids), logits=1, sampling=SAMPLING[i]), ids))
        got = await ring.batch(seq, parts)
        for i, t in enumerate(toks):
            t += got.get(names[i], ())
        seq += 1
    for n in names:
        await ring.ws.send_bytes(encode(Close(term=ring.term, stream=n)))
    return toks


async def _until_pool_full(nodes: list[str]) -> list[dict[str, Any]]:
    """The stages' status once every KV block is free again (Close frames travel the ring)."""
    for _ in range(100):
        stages = [_stage(n) for n in nodes]
        if all(s["kv_blocks_free"] == s["kv_blocks_total"] for s in stages):
            return stages
        await asyncio.sleep(0.1)
    return stages


def test_a_micro_batch_gives_every_stream_the_tokens_it_gets_alone(
    paged: LocalCluster, stateful: LocalCluster, export: Path, prompts: list[list[int]], solo_paged: list[list[int]]
) -> None:
    """4 streams of different prompt lengths (one prompt in two chunks, one stream sampling
    with a seed) computed together, a step a micro-batch: each stream's tokens are those it
    gets alone in Fwd frames, on the same paged agents and on stateful ones; closing the
    streams gives every KV block back."""

    async def go() -> tuple[list[list[int]], list[dict[str, Any]], list[dict[str, Any]]]:
        async with Ring(paged.nodes, export, next(_terms)) as ring:
            during = [_stage(n) for n in paged.nodes]
            toks = await _batched(ring, prompts)
            return toks, during, await _until_pool_full(paged.nodes)

    batched, before, after = aio.run(go())
    assert [s["attention"] for s in before] == ["paged", "paged"]
    # each pool is a quarter of the memory its agent had free, within 64 MiB..1 GiB, f32 on CPU
    assert all(64 - 2 <= s["kv_pool_mb"] <= 1024 and s["kv_precision"] == "f32" for s in before), before
    assert batched == solo_paged
    assert _alone(stateful, export, prompts) == solo_paged
    assert [_stage(n)["attention"] for n in stateful.nodes] == ["stateful", "stateful"]
    assert all(s["kv_blocks_free"] == s["kv_blocks_total"] > 0 for s in after), after


def test_bad_parts_get_errors_naming_their_streams_and_the_others_go_on(
    paged: LocalCluster, export: Path, prompts: list[list[int]], solo_paged: list[list[int]]
) -> None:
    """In one micro-batch beside two good streams: another connection's stream, an unknown
    stream, a rollback longer than its stream and a part over the step's token budget. Each
    bad part gets an Error naming its stream; the good streams' tokens do not change."""

    async def go() -> tuple[list[list[int]], dict[str, Error], Error, list[dict[str, Any]]]:
        async with Ring(paged.nodes, export, next(_terms)) as ring:
            a, b = prompts[0], prompts[1]
            got = await ring.batch(
                0,
                [
                    (Part("a", 0, len(a), start=True, logits=1), a),
                    (Part("b", 0, len(b), start=True, logits=1), b),
                    (Part("short", 0, 3, start=True, logits=1), [1, 2, 3]),
                ],
            )
            toks = [list(got["a"]), list(got["b"])]
            # someone else names stream "a": refused, "a" goes on untouched
            intruder = await ring.other()
            one = np.asarray([toks[0][-1]], dtype=np.int32)
            await intruder.send_bytes(encode(Batch(term=ring.term, seq=1, dtype="i32", parts=(Part("a", 1, 1),)), one))
            refused = await ring.reply(intruder)
            await intruder.close()
            assert isinstance(refused, Error)
            errors: dict[str, Error] = {}
            seq = 1
            while len(toks[0]) < TOKENS:
                parts = [
                    (Part("a", seq, 1, logits=1), [toks[0][-1]]),
                    (Part("b", seq, 1, logits=1), [toks[1][-1]]),
                ]
                if seq == 1:
                    parts[1:1] = [
                        (Part("ghost", seq, 1, logits=1), [5]),  # never started
                        (Part("short", seq, 1, rollback=10, logits=1), [5]),  # 3 tokens only
                        (Part("huge", seq, BUDGET + 1, start=True, logits=1), [7] * (BUDGET + 1)),
                    ]
                got = await ring.batch(seq, parts)
                assert set(got) == {"a", "b"}
                toks[0] += got["a"]
                toks[1] += got["b"]
                seq += 1
                while seq == 2 and len(errors) < 3:
                    err = await ring.reply(ring.ws)
                    assert isinstance(err, Error) and err.stream is not None
                    errors[err.stream] = err
            for s in ("a", "b"):
                await ring.ws.send_bytes(encode(Close(term=ring.term, stream=s)))
            return toks, errors, refused, await _until_pool_full(paged.nodes)

    toks, errors, refused, after = aio.run(go())
    assert toks == [solo_paged[0], solo_paged[1]]
    assert (refused.code, refused.stream) == ("not_owner", "a")
    assert {s: e.code for s, e in errors.items()} == {
        "ghost": "unknown_stream",
        "short": "bad_input",
        "huge": "bad_input",
    }
    assert "roll back 10" in errors["short"].message and f"budget of {BUDGET}" in errors["huge"].message
    assert all(s["kv_blocks_free"] == s["kv_blocks_total"] for s in after), after  # "short" failed, freed


def test_a_stateful_stage_refuses_a_micro_batch_by_stream(stateful: LocalCluster, export: Path) -> None:
    async def go() -> Message:
        async with Ring(stateful.nodes, export, next(_terms)) as ring:
            part = Part("x", 0, 2, start=True, logits=1)
            await ring.ws.send_bytes(encode(Batch(ring.term, 0, "i32", (part,)), np.array([1, 2], dtype=np.int32)))
            return await ring.reply(ring.ws)

    err = aio.run(go())
    assert isinstance(err, Error) and (err.code, err.stream) == ("unexpected", "x"), err
    assert "takes Fwd frames" in err.message


def test_a_full_pool_fails_only_the_parts_that_need_new_blocks(export: Path) -> None:
    """A stage of 4 KV blocks (32 tokens each), in process: parts that take no new block run
    (a rollback's freed block counts first), then the others in batch order while blocks
    last; a part left out fails with the retryable ``no_blocks`` and changes nothing."""
    stage = PagedStage(export / "stage_0", device="CPU", threads=1, exact=True, num_blocks=4)
    worker = PagedWorker(stage, max_streams=8)

    def step(seq: int, parts: list[Part]) -> tuple[list[str], dict[str, str]]:
        ids = np.arange(100, 100 + sum(p.n for p in parts), dtype=np.int32)
        msg = Batch(term=1, seq=seq, dtype="i32", parts=tuple(parts))
        out = worker.batch(msg, memoryview(ids.tobytes()), range(len(parts)), "f32")
        ran = [] if out.frame is None else [p.stream for p in cast(Batch, decode(out.frame)[0]).parts]
        return ran, {str(e.stream): e.code for e in out.failed}

    assert step(0, [Part("a", 0, 40, start=True), Part("b", 0, 20, start=True)]) == (["a", "b"], {})
    assert stage.free_blocks == 1  # a: 2 blocks, b: 1
    ran, failed = step(
        1, [Part("a", 1, 1), Part("c", 0, 33, start=True), Part("b", 1, 12), Part("d", 0, 10, start=True)]
    )
    assert (ran, failed) == (["a", "b", "d"], {"c": "no_blocks"})  # c needs 2 blocks, d the last one
    assert stage.free_blocks == 0 and "c" not in worker.ids and stage.length(worker.ids["a"]) == 41
    # a's rollback frees its second block, which lets c (before a in the batch) start
    ran, failed = step(2, [Part("c", 0, 20, start=True), Part("a", 2, 1, rollback=10), Part("b", 2, 1)])
    assert (ran, failed) == (["c", "a"], {"b": "no_blocks"})  # b's 33rd token needs a second block
    assert stage.length(worker.ids["b"]) == 32 and stage.length(worker.ids["a"]) == 32
    worker.close_all()
    assert stage.free_blocks == 4


@pytest.mark.parametrize("batching", [False, True])
def test_the_coordinator_generates_the_same_text_on_paged_agents(
    paged: LocalCluster, stateful: LocalCluster, smollm2: Any, prompts: list[list[int]], batching: bool
) -> None:
    """The coordinator's greedy and seeded requests, 3 at a time, on paged stages give the
    tokens they give on stateful agents: with continuous batching (micro-batches of all three),
    and without (Fwd frames, the ring running plain decoding on its own, Fwd.auto)."""
    jobs = [(tuple(p), s) for p, s in zip(prompts[:3], (GREEDY, GREEDY, SAMPLED), strict=True)]

    def run(nodes: list[str]) -> list[list[int]]:
        async def go() -> list[list[int]]:
            cfg = exact_config(smollm2, nodes, next(_terms), max_streams=4, failover=False, batching=batching)
            coord = Coordinator(cfg)
            await coord.async_start()
            try:
                sched = coord.scheduler
                assert isinstance(sched, Batcher) == (batching and nodes == paged.nodes)

                async def one(prompt: tuple[int, ...], s: SamplingSpec) -> list[int]:
                    req = GenRequest(prompt=prompt, max_tokens=24, sampling=s)
                    return [t async for t in sched.async_generate(req)]

                return list(await asyncio.gather(*[one(p, s) for p, s in jobs]))
            finally:
                await coord.async_stop()

        return aio.run(go())

    on_paged = run(paged.nodes)
    assert [_stage(n)["attention"] for n in paged.nodes] == ["paged", "paged"]
    assert on_paged == run(stateful.nodes)
    assert all(len(t) == 24 for t in on_paged)


def test_speculative_decoding_on_paged_agents_gives_the_plain_tokens(
    paged: LocalCluster, smollm2: Any, prompts: list[list[int]]
) -> None:
    """Verify steps of K+1 tokens and rollbacks of the rejected ones, through paged stages:
    the same greedy tokens as plain decoding on the same agents."""

    counters = SpecCounters()

    async def go() -> list[list[int]]:
        cfg = exact_config(
            smollm2,
            paged.nodes,
            next(_terms),
            draft="smollm2-135m",
            draft_weights="int4",
            failover=False,
            batching=False,  # speculation runs on the per-stream path (micro-batches do not carry it yet)
        )
        coord = Coordinator(cfg)
        await coord.async_start()
        try:
            sched = coord.scheduler
            assert sched is not None and sched.speculator is not None

            async def one(prompt: list[int], k: int) -> list[int]:
                req = GenRequest(tuple(prompt), max_tokens=24, spec_k=k, spec_counters=counters if k else None)
                return [t async for t in sched.async_generate(req)]

            return [await one(p, k) for k in (0, 3) for p in prompts[:2]]
        finally:
            await coord.async_stop()

    plain_a, plain_b, spec_a, spec_b = aio.run(go())
    assert counters.rounds > 0 and counters.accepted < counters.proposed  # some drafts were rolled back
    assert [spec_a, spec_b] == [plain_a, plain_b]


def test_agents_left_at_their_defaults_attend_paged_and_the_coordinator_batches(
    smollm2: Any, prompts: list[list[int]]
) -> None:
    """What an office gets without touching a setting: every CPU agent's stage compiles paged,
    the coordinator batches continuously, and users asking at once share micro-batches."""
    with LocalCluster(2, threads=1) as c:

        async def go() -> tuple[list[list[int]], dict[str, float | int]]:
            coord = Coordinator(exact_config(smollm2, c.nodes, next(_terms), max_streams=4, failover=False))
            await coord.async_start()
            try:
                sched = coord.scheduler
                assert isinstance(sched, Batcher)

                async def one(prompt: list[int]) -> list[int]:
                    return [t async for t in sched.async_generate(GenRequest(prompt=tuple(prompt), max_tokens=16))]

                return list(await asyncio.gather(*[one(p) for p in prompts])), sched.summary()
            finally:
                await coord.async_stop()

        answers, summary = aio.run(go())
        stages = [_stage(n) for n in c.nodes]
    assert [s["attention"] for s in stages] == ["paged", "paged"]
    assert all(s["kv_pool_mb"] > 0 for s in stages)
    assert all(len(a) == 16 for a in answers)
    assert summary["parts_per_batch"] > 1, summary  # the users' steps shared inferences
