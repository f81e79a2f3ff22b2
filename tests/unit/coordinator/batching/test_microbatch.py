"""The micro-batch policy: table-driven rules, and a simulation against a real block pool."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest

from agent.runtime.blocks import BlockPool
from coordinator.batching.microbatch import (
    DECODE,
    JOIN,
    PREFILL,
    QUEUE,
    REJECT,
    TOO_LONG,
    VERIFY,
    Admission,
    Plan,
    QueueState,
    RingState,
    SchedState,
    StateError,
    StreamState,
    admit,
    next_batch,
)


def ring(**kw: int) -> RingState:
    base = {"stages": 1, "token_budget": 64, "free_blocks": 100, "total_blocks": 100, "block_size": 32}
    return RingState(**(base | kw))


def dec(
    name: str,
    arrival: int,
    context: int = 40,
    *,
    blocks: int | None = None,
    k: int = 0,
    rollback: int = 0,
    in_flight: int | None = None,
    ready_since: int = 0,
) -> StreamState:
    """A started stream in its decode phase, holding the blocks its context needs (or ``blocks``)."""
    held = -(-context // 32) if blocks is None else blocks
    return StreamState(name, arrival, 0, context, held, in_flight, k, rollback, ready_since)


def new(name: str, arrival: int, prompt: int) -> StreamState:
    return StreamState(name, arrival, prefill=prompt)


def plan_of(r: RingState, *streams: StreamState) -> Plan | None:
    return next_batch(SchedState(r, streams))


def shape(p: Plan | None) -> list[tuple[str, str, int, int]]:
    assert p is not None
    return [(x.stream, x.kind, x.n, x.logits) for x in p.parts]


# (case, ring, streams, expected parts as (stream, kind, rows, tokens asked))
BUDGET_CASES = [
    (
        "decodes first, then a prompt chunk fills the budget",
        ring(token_budget=16),
        [new("c", 2, 40), dec("a", 0), dec("b", 1, k=3)],
        [("a", DECODE, 1, 1), ("b", VERIFY, 4, 4), ("c", PREFILL, 11, 0)],
    ),
    (
        "a short prompt goes whole and its chunk asks for one token",
        ring(token_budget=16),
        [new("c", 0, 5)],
        [("c", PREFILL, 5, 1)],
    ),
    (
        "a long prompt is chunked so the decodes never wait for it",
        ring(token_budget=8),
        [new("p", 0, 1000), dec("a", 1), dec("b", 2)],
        [("a", DECODE, 1, 1), ("b", DECODE, 1, 1), ("p", PREFILL, 6, 0)],
    ),
    (
        "a prompt already begun goes before a new one, each oldest first",
        ring(token_budget=10),
        [new("d", 1, 20), StreamState("c", 3, prefill=4, context=32, blocks=1), new("e", 2, 20)],
        [("c", PREFILL, 4, 1), ("d", PREFILL, 6, 0)],
    ),
    (
        "a verify is cut to the budget (fewer drafts), never skipped",
        ring(token_budget=3),
        [dec("a", 0, k=5)],
        [("a", VERIFY, 3, 3)],
    ),
    (
        "under a tight budget the longest-waiting decode goes first",
        ring(token_budget=1),
        [dec("a", 0, ready_since=5), dec("b", 1, ready_since=2)],
        [("b", DECODE, 1, 1)],
    ),
    (
        "streams in flight are skipped; the ready ones go",
        ring(token_budget=16, stages=2, in_flight=1),
        [dec("a", 0, in_flight=7), dec("b", 1), new("c", 2, 100)],
        [("b", DECODE, 1, 1), ("c", PREFILL, 15, 0)],
    ),
]


@pytest.mark.parametrize(("case", "r", "streams", "want"), BUDGET_CASES, ids=[c[0] for c in BUDGET_CASES])
def test_budget_is_filled_by_decodes_then_prompt_chunks(
    case: str, r: RingState, streams: list[StreamState], want: list[tuple[str, str, int, int]]
) -> None:
    p = plan_of(r, *streams)
    assert shape(p) == want, case
    assert p is not None and p.rows <= r.token_budget


def test_parts_carry_start_and_the_previous_verify_rollback() -> None:
    p = plan_of(ring(), dec("a", 0, context=40, rollback=3, k=2), new("b", 1, 10))
    assert p is not None
    a, b = p.parts
    assert (a.rollback, a.start, a.drafts) == (3, False, 2)
    assert (b.rollback, b.start, b.drafts) == (0, True, 0)


def test_a_long_prompt_is_sent_in_budget_sized_chunks_only_the_last_asking_for_a_token() -> None:
    s, r, chunks = new("p", 0, 200), ring(token_budget=64), []
    while s.prefill:
        p = plan_of(r, s)
        assert p is not None and len(p.parts) == 1
        part = p.parts[0]
        chunks.append((part.n, part.logits, part.start))
        s = replace(s, prefill=s.prefill - part.n, context=s.context + part.n, blocks=part.blocks)
    assert chunks == [(64, 0, True), (64, 0, False), (64, 0, False), (8, 1, False)]


def test_about_s_micro_batches_are_in_flight_each_with_its_share_of_the_streams() -> None:
    streams = [dec(f"s{i}", i) for i in range(8)]
    r = ring(stages=2)
    first = plan_of(r, *streams)
    assert first is not None and [x.stream for x in first.parts] == ["s0", "s1", "s2", "s3"]
    streams = [replace(s, in_flight=1) if i < 4 else s for i, s in enumerate(streams)]
    second = plan_of(replace(r, in_flight=1), *streams)
    assert second is not None and [x.stream for x in second.parts] == ["s4", "s5", "s6", "s7"]
    streams = [replace(s, in_flight=2) if i >= 4 else s for i, s in enumerate(streams)]
    assert plan_of(replace(r, in_flight=2), *streams) is None  # S out: nothing more


@pytest.mark.parametrize(
    ("case", "r", "streams", "sends"),
    [
        ("S already out", ring(stages=3, in_flight=3), [dec("a", 0)], False),
        ("fewer than S out, a stream ready", ring(stages=3, in_flight=2), [dec("a", 0)], True),
        ("fewer than S out, nothing ready", ring(stages=3, in_flight=1), [dec("a", 0, in_flight=4)], False),
        ("a lower cap than S", ring(stages=3, in_flight=1, max_in_flight=1), [dec("a", 0)], False),
        ("no streams at all", ring(), [], False),
    ],
)
def test_in_flight_cap(case: str, r: RingState, streams: list[StreamState], sends: bool) -> None:
    assert (plan_of(r, *streams) is not None) == sends, case


def test_when_blocks_run_out_the_newest_stream_waits() -> None:
    # both streams fill their block exactly: the next token needs a new block, and one is free
    p = plan_of(ring(free_blocks=1), dec("new", 5, context=32), dec("old", 1, context=32))
    assert p is not None
    assert [x.stream for x in p.parts] == ["old"] and p.parts[0].grant == 1
    assert p.waiting == ("new",) and p.preempt == ()


def test_a_stream_that_needs_no_new_block_goes_on_while_another_waits() -> None:
    p = plan_of(ring(free_blocks=0, total_blocks=3), dec("old", 0, context=40), dec("full", 1, context=64))
    assert p is not None and [x.stream for x in p.parts] == ["old"] and p.waiting == ("full",)


def test_the_oldest_gets_the_last_block_even_when_a_newer_one_has_waited_longer() -> None:
    old, young = dec("old", 0, context=32, ready_since=9), dec("young", 1, context=32, ready_since=1)
    p = plan_of(ring(free_blocks=1), young, old)
    assert p is not None and [x.stream for x in p.parts] == ["old"] and p.waiting == ("young",)


def test_a_new_prompt_waits_for_the_blocks_of_its_whole_prompt_and_younger_ones_wait_behind_it() -> None:
    # 3 blocks free: the 100-token prompt needs 4 and waits; the 10-token one behind it waits too
    p = plan_of(ring(free_blocks=3, total_blocks=10), new("big", 0, 100), new("small", 1, 10), dec("d", 2))
    assert p is not None and [x.stream for x in p.parts] == ["d"]
    assert p.waiting == ("big", "small")


def test_a_verify_is_cut_to_the_blocks_left() -> None:
    p = plan_of(ring(free_blocks=0, total_blocks=2), dec("a", 0, context=30, k=5))
    assert p is not None and p.parts[0].kind == VERIFY and p.parts[0].n == 2 and p.parts[0].grant == 0


@pytest.mark.parametrize(
    ("case", "streams", "preempt", "parts"),
    [
        (
            "the newest running stream is preempted for the oldest",
            [dec("old", 0, context=64), dec("mid", 1, context=40), dec("newest", 2, context=10)],
            ("newest",),
            ["mid"],
        ),
        (
            "only the newest: the others go on in the room their blocks have left",
            [dec("old", 0, context=64, k=2), dec("a", 1, context=60), dec("b", 2, context=20), dec("c", 3, context=10)],
            ("c",),
            ["a", "b"],
        ),
        (
            "one in flight is passed over: the next newest goes",
            [dec("old", 0, context=64), dec("mid", 1, context=40), dec("newest", 2, context=10, in_flight=3)],
            ("mid",),
            [],
        ),
        (
            "none can free enough now: nobody is preempted, the oldest waits",
            [dec("old", 0, context=64), dec("x", 1, context=60, in_flight=3)],
            (),
            None,
        ),
    ],
)
def test_preemption_when_even_the_oldest_cannot_take_a_token(
    case: str, streams: list[StreamState], preempt: tuple[str, ...], parts: list[str] | None
) -> None:
    held = sum(s.blocks for s in streams)
    r = ring(free_blocks=0, total_blocks=held, in_flight=1, stages=2)
    p = plan_of(r, *streams)
    if parts is None:
        assert p is None, case
        return
    assert p is not None and p.preempt == preempt, case
    assert [x.stream for x in p.parts] == parts and "old" in p.waiting  # the freed blocks wait for the closes


def test_a_stream_too_long_for_the_pool_is_named_not_stalled() -> None:
    # the pool holds 64 tokens, all of them "huge"'s: its next token can never fit
    p = plan_of(ring(free_blocks=0, total_blocks=2), dec("huge", 0, context=64), new("b", 1, 10))
    assert p is not None and p.too_long == ("huge",) and p.parts == () and p.waiting == ("b",)
    assert p.preempt == ()  # nobody is preempted for a stream that can never fit
    after = plan_of(ring(free_blocks=2, total_blocks=2), new("b", 1, 10))  # once it is failed and closed
    assert after is not None and [x.stream for x in after.parts] == ["b"]


# (case, queue, limit, verdict, retry after)
ADMIT_CASES = [
    ("room now: joins the next step", QueueState(100, 0, 3, 10, 100, 32), 4, JOIN, 0),
    ("others wait ahead: queues", QueueState(100, 2, 3, 10, 100, 32), 4, QUEUE, 0),
    ("no blocks for its prompt: queues", QueueState(100, 0, 3, 3, 100, 32), 4, QUEUE, 0),
    ("no stream slot: queues", QueueState(10, 0, 8, 10, 100, 32, max_streams=8), 4, QUEUE, 0),
    ("queue full: 503, a slot frees in 2 s", QueueState(10, 4, 3, 0, 100, 32, finished_per_s=0.5), 4, REJECT, 2),
    ("queue full, rate unknown", QueueState(10, 4, 3, 0, 100, 32), 4, REJECT, 5),
    ("queue full and slow: capped", QueueState(10, 9, 3, 0, 100, 32, finished_per_s=0.01), 4, REJECT, 60),
    ("queue full and fast: at least 1 s", QueueState(10, 4, 3, 0, 100, 32, finished_per_s=50.0), 4, REJECT, 1),
    ("a prompt the pool cannot hold", QueueState(3200, 0, 0, 100, 100, 32), 4, TOO_LONG, 0),
    ("no queue at all", QueueState(10, 1, 3, 0, 100, 32), 0, REJECT, 5),
]


@pytest.mark.parametrize(("case", "q", "limit", "verdict", "retry"), ADMIT_CASES, ids=[c[0] for c in ADMIT_CASES])
def test_admit(case: str, q: QueueState, limit: int, verdict: str, retry: int) -> None:
    a = admit(q, limit)
    assert (a.verdict, a.retry_after_s) == (verdict, retry), case
    if verdict in (REJECT, TOO_LONG):
        assert a.reason


@pytest.mark.parametrize(
    ("case", "r", "streams", "says"),
    [
        ("a stream twice", ring(), [dec("a", 0), dec("a", 1)], "twice"),
        ("an empty stream", ring(), [StreamState("a", 0)], "neither"),
        ("a context over its blocks", ring(), [dec("a", 0, context=70, blocks=2)], "fit"),
        ("more micro-batches than in flight", ring(), [dec("a", 0, in_flight=1)], "in flight"),
        ("free over total", ring(free_blocks=5, total_blocks=4), [], "free blocks"),
        ("a budget over a frame", ring(token_budget=1 << 20), [], "budget"),
    ],
)
def test_bad_state_gets_a_clear_error(case: str, r: RingState, streams: list[StreamState], says: str) -> None:
    with pytest.raises(StateError, match=says):
        plan_of(r, *streams)


def test_bad_admission_input_gets_a_clear_error() -> None:
    with pytest.raises(StateError, match="prompt 0"):
        admit(QueueState(0, 0, 0, 1, 1, 32), 1)
    assert admit(QueueState(1, 0, 0, 1, 1, 32), 1) == Admission(JOIN)


# simulation ---------------------------------------------------------------------------------
@dataclass
class Sim:
    """A stream as the scheduler would track it: its tokens, and its state for the policy."""

    state: StreamState
    prompt: int
    want: int  # tokens to generate
    got: int = 0
    parts: int = 0


def run_sim(seed: int) -> tuple[int, int]:
    """Random arrivals, lengths and speculation over the pure policy, with a real BlockPool as
    every stage's pool (each plan is applied to it as a stage would: rollbacks, then an
    all-or-nothing reservation). Returns (preemptions, waits)."""
    rnd = random.Random(seed)
    bs, total = 4, 40
    r = ring(stages=rnd.randint(1, 3), token_budget=rnd.choice([8, 16, 24]), free_blocks=total, total_blocks=total)
    r = replace(r, block_size=bs)
    pool = BlockPool(total, bs)
    ids: dict[str, int] = {}
    live: dict[str, Sim] = {}
    arrivals = sorted(rnd.randrange(300) for _ in range(24))
    count = len(arrivals)
    out: list[tuple[int, Plan]] = []  # micro-batches in flight, in ring order
    done, preempted, waits, tick, batch_no = 0, 0, 0, 0, 0
    while done < count:
        tick += 1
        assert tick < 20_000, f"seed {seed}: streams starve: {[(k, v.state) for k, v in live.items()]}"
        while arrivals and arrivals[0] <= tick:
            arrivals.pop(0)
            name = f"s{len(ids)}"
            ids[name] = len(ids)
            prompt = rnd.randint(1, 80)
            k = rnd.choice([0, 0, 2, 4])
            live[name] = Sim(
                StreamState(name, ids[name], prefill=prompt, k=k, ready_since=tick), prompt, rnd.randint(1, 30)
            )
        while True:
            plan = next_batch(SchedState(replace(r, in_flight=len(out)), tuple(s.state for s in live.values())))
            if plan is None:
                break
            assert plan.too_long == ()
            assert plan.rows <= r.token_budget and len({p.stream for p in plan.parts}) == len(plan.parts)
            waits += len(plan.waiting)
            for name in plan.preempt:  # closed on every stage; recomputed from its tokens
                s = live[name]
                pool.close(ids[name])
                r = replace(r, free_blocks=r.free_blocks + s.state.blocks)
                s.state = replace(s.state, prefill=s.prompt + s.got, context=0, blocks=0, rollback=0)
                preempted += 1
            if not plan.parts:
                continue
            batch_no += 1
            for p in plan.parts:  # as a stage applies it
                if p.start:
                    pool.open(ids[p.stream])
                pool.rollback(ids[p.stream], p.rollback)
            pool.reserve([(ids[p.stream], p.n) for p in plan.parts])
            for p in plan.parts:
                pool.commit(ids[p.stream], p.n)
                s = live[p.stream]
                st = s.state
                assert st.in_flight is None
                if p.kind == PREFILL:  # a prompt, or after a preemption every token so far
                    assert st.context + st.prefill == s.prompt + s.got and p.start == (st.context == 0)
                else:  # every token but the last generated one is in the cache: none lost or twice
                    assert st.context - st.rollback == s.prompt + s.got - 1 and not p.start
                left = st.prefill - p.n if p.kind == PREFILL else 0
                s.state = replace(st, prefill=left, context=st.context - st.rollback + p.n, blocks=p.blocks)
                s.state = replace(s.state, rollback=0, in_flight=batch_no)
                assert len(pool.table(ids[p.stream])) == p.blocks
            r = replace(r, free_blocks=r.free_blocks - plan.grant)
            assert r.free_blocks == pool.free_blocks >= 0  # the ledger is the pool
            out.append((batch_no, plan))
        assert len(out) <= r.stages
        if out:  # the oldest micro-batch comes back
            _, plan = out.pop(0)
            for p in plan.parts:
                s = live[p.stream]
                s.parts += 1
                gained, rollback = 0, 0
                if p.kind == PREFILL:
                    gained = p.logits
                elif p.kind == VERIFY:
                    accepted = rnd.randint(0, p.drafts)
                    gained, rollback = accepted + 1, p.drafts - accepted
                else:
                    gained = 1
                s.got = min(s.want, s.got + gained)
                s.state = replace(s.state, in_flight=None, rollback=rollback, ready_since=tick)
                if s.got >= s.want:
                    pool.close(ids[p.stream])
                    r = replace(r, free_blocks=r.free_blocks + s.state.blocks)
                    del live[p.stream]
                    done += 1
    assert pool.free_blocks == total == r.free_blocks and not pool.streams
    return preempted, waits


def test_simulated_arrivals_every_stream_finishes_and_the_pool_returns_to_full() -> None:
    preempted = waited = 0
    for seed in range(40):
        p, w = run_sim(seed)
        preempted, waited = preempted + p, waited + w
    assert preempted > 0 and waited > 0  # the pool was short: both rules ran
