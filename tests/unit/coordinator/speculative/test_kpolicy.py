"""The K policy: a pure function of measured costs, and the estimator that feeds it."""

from __future__ import annotations

import pytest

from coordinator.speculative.kpolicy import (
    MAX_THRESHOLD,
    SpecCosts,
    SpecStats,
    ahead_threshold,
    choose_k,
    draft_threshold,
    expected_tokens,
    match_bar,
    match_round_pays,
    prefill_added,
    prefill_pays,
    tokens_per_s,
)


@pytest.mark.parametrize(
    ("acceptance", "k", "tokens"),
    [(0.0, 5, 1.0), (1.0, 5, 6.0), (0.5, 1, 1.5), (0.5, 3, 1.875), (0.8, 0, 1.0)],
)
def test_expected_tokens(acceptance: float, k: int, tokens: float) -> None:
    assert expected_tokens(acceptance, k) == pytest.approx(tokens)


# (case, acceptance, draft_s, step_s, extra_s, lowest K allowed, highest K allowed)
CASES = [
    # 2-core CPU, one node: compute-bound, the draft costs 36% of a target step, a 4-token
    # verify costs 1.7x a 1-token step: speculation does not pay
    ("cpu-lan-model-draft", 0.6, 0.036, 0.100, 0.023, 0, 0),
    # same machine, free prompt-lookup drafts that are usually right (a code edit)
    ("cpu-lan-lookup-code", 0.85, 0.0, 0.100, 0.023, 2, 16),
    # drafts are never right: never speculate, however cheap
    ("useless-drafts", 0.0, 0.0, 0.100, 0.001, 0, 0),
    # memory-bound GPU node on a LAN: verify is nearly free, moderate K
    ("gpu-lan", 0.7, 0.004, 0.040, 0.002, 3, 8),
    # 2 stages, 100 ms per hop: the 300 ms round trip dominates, long K
    ("wan-100ms", 0.85, 0.025, 0.440, 0.030, 5, 16),
    # 20 ms per hop: in between
    ("wan-20ms", 0.75, 0.025, 0.200, 0.030, 3, 12),
]


@pytest.mark.parametrize(("case", "acc", "draft", "step", "extra", "lo", "hi"), CASES, ids=[c[0] for c in CASES])
def test_choose_k(case: str, acc: float, draft: float, step: float, extra: float, lo: int, hi: int) -> None:
    c = SpecCosts(acc, draft, step, extra)
    k = choose_k(c)
    assert lo <= k <= hi, (case, k)
    if k:  # the chosen K beats plain and every other K
        assert tokens_per_s(c, k) > tokens_per_s(c, 0)
        assert all(tokens_per_s(c, k) >= tokens_per_s(c, j) for j in range(17))


def test_longer_round_trips_never_shorten_k() -> None:
    ks = [choose_k(SpecCosts(0.7, 0.02, 0.05 + rtt, 0.02)) for rtt in (0.0, 0.02, 0.05, 0.1, 0.2, 0.4)]
    assert ks == sorted(ks) and ks[-1] > ks[0]


def _simulate(
    stats: SpecStats, acc: float, draft: float, step: float, extra: float, rounds: int, hidden: float = 0.0
) -> list[int]:
    """Feed the estimator rounds of a machine with these true costs (deterministic acceptance).

    ``hidden``: a speculative round's cost that neither the draft's nor the step's timing
    shows (say, the draft and the stage fighting over the same cores)."""
    chosen = []
    carry = 0.0
    for _ in range(rounds):
        k = stats.next_k(1000)
        chosen.append(k)
        a = 0
        if k:
            stats.observe_draft(draft * k, k)
            # accept a fraction ``acc`` of drafts on average, as whole-token prefixes
            carry += acc * k
            a = min(int(carry), k)
            carry -= a
            stats.observe_accept(k, a)
        stats.observe_step(k + 1, step + extra * k)
        stats.observe_yield(k > 0, a + 1, draft * k + step + extra * k + (hidden if k else 0.0))
    return chosen


def test_estimator_learns_to_stop_speculating_when_it_does_not_pay() -> None:
    ks = _simulate(SpecStats(), acc=0.3, draft=0.04, step=0.1, extra=0.03, rounds=300)
    tail = ks[-100:]
    assert tail.count(0) >= 95  # plain, apart from rare probes


def test_rounds_that_deliver_less_than_plain_turn_speculation_off() -> None:
    # the timed costs promise a gain (cheap draft, high acceptance); each round really costs
    # half a step more than they show: what the stream gets decides
    ks = _simulate(SpecStats(), acc=0.7, draft=0.03, step=0.1, extra=0.02, rounds=300, hidden=0.2)
    assert ks[-100:].count(0) >= 90
    # the same costs, nothing hidden: it speculates
    ks = _simulate(SpecStats(), acc=0.7, draft=0.03, step=0.1, extra=0.02, rounds=300)
    assert ks[-100:].count(0) <= 10


def test_estimator_learns_a_long_k_over_a_wan() -> None:
    ks = _simulate(SpecStats(), acc=0.9, draft=0.02, step=0.44, extra=0.03, rounds=200)
    assert min(ks[-50:]) >= 0 and sorted(ks[-50:])[25] >= 7


# (case, acceptance, draft_s, step_s, extra_s, lowest bar, highest bar)
THRESHOLDS = [
    # a 100 ms/hop WAN: a token costs ~a round trip, a draft ~30 ms: draft on through doubt
    ("wan-100ms", 0.66, 0.030, 0.500, 0.010, 0.05, 0.35),
    # one compute-bound node: a draft costs a third of a step: only sure drafts pay
    ("cpu-one-node", 0.8, 0.036, 0.100, 0.023, 0.45, MAX_THRESHOLD),
    # drafts that cost nothing (prompt lookup) on a fast link: almost any guess pays
    ("free-drafts", 0.5, 0.0, 0.100, 0.001, 0.0, 0.05),
    # drafting dearer than the tokens it could win: capped, never above the cap
    ("dear-drafts", 0.5, 1.0, 0.100, 0.050, MAX_THRESHOLD, MAX_THRESHOLD),
]


@pytest.mark.parametrize(
    ("case", "acc", "draft", "step", "extra", "lo", "hi"), THRESHOLDS, ids=[c[0] for c in THRESHOLDS]
)
def test_draft_threshold(case: str, acc: float, draft: float, step: float, extra: float, lo: float, hi: float) -> None:
    c = SpecCosts(acc, draft, step, extra)
    bar = draft_threshold(c, max(choose_k(c), 1))
    assert lo <= bar <= hi, (case, bar)


def test_longer_round_trips_lower_the_bar() -> None:
    bars = [draft_threshold(SpecCosts(0.7, 0.03, 0.1 + rtt, 0.02), 6) for rtt in (0.0, 0.05, 0.1, 0.3, 0.6)]
    assert bars == sorted(bars, reverse=True) and bars[-1] < bars[0] / 2


# (case, round time of a plain step, the busiest stage's compute in it, lowest bar, highest bar)
AHEAD = [
    # one compute-bound node: the stage is busy all round; a voided frame costs a whole step
    ("one-node", 0.036, 0.034, 0.9, 1.0),
    # two stages on a LAN: each idles while the other computes
    ("lan-2-stages", 0.110, 0.055, 0.4, 0.6),
    # 100 ms/hop: the stages idle most of a round; drafting ahead pays on even odds
    ("wan-100ms", 0.500, 0.060, 0.0, 0.15),
    # agents that do not report compute: no bar
    ("unknown", 0.100, None, 0.0, 0.0),
]


@pytest.mark.parametrize(("case", "step", "busy", "lo", "hi"), AHEAD, ids=[c[0] for c in AHEAD])
def test_ahead_threshold(case: str, step: float, busy: float | None, lo: float, hi: float) -> None:
    assert lo <= ahead_threshold(step, busy) <= hi, case


def test_estimator_learns_the_bottleneck_from_plain_steps() -> None:
    stats = SpecStats()
    assert stats.ahead_bar() == 0.0  # nothing measured: no bar
    for _ in range(40):
        stats.observe_step(1, 0.5, busy_s=0.06)
        stats.observe_step(5, 0.7, busy_s=0.2)  # a verify step's compute is not a plain step's
    assert stats.ahead_bar() == pytest.approx(0.12, abs=0.01)


def test_plain_round_the_ring_raises_the_bar_for_speculating() -> None:
    # 100 ms/hop, 2 stages: a coordinator-driven round has 3 hops, the ring's own 2; middling
    # drafts beat coordinator-driven steps (3.9 vs 2.9 tok/s at K=2) but not the ring (4.0)
    c = SpecCosts(0.5, 0.02, 0.35, 0.03)
    assert choose_k(c) == 2
    ring = SpecCosts(0.5, 0.02, 0.35, 0.03, plain_s=0.25)
    assert tokens_per_s(ring, 0) == pytest.approx(4.0)
    assert choose_k(ring) == 0


# (case, seed the policy on plain?, speculating?, limit, plain rounds given)
PLAIN_ROUNDS = [
    ("settled-on-plain", True, False, 1000, 7),  # up to the next probe (every 8 rounds at first)
    ("few-tokens-left", True, False, 3, 3),
    ("one-token-left", True, False, 1, 1),
    ("speculating: a plain probe is the coordinator's", False, True, 1000, 1),
    ("nothing timed yet: the coordinator times a step", None, False, 1000, 1),
]


@pytest.mark.parametrize(("case", "plain", "spec", "limit", "want"), PLAIN_ROUNDS, ids=[c[0] for c in PLAIN_ROUNDS])
def test_plain_rounds(case: str, plain: bool | None, spec: bool, limit: int, want: int) -> None:
    s = SpecStats()
    if plain is not None:  # costs under which plain pays (dear drafts), or speculation does (free ones)
        s.step_s, s.extra_s, s.draft_s = 0.1, 0.01, (1.0 if plain else 0.0)
        s.acceptance = 0.1 if plain else 0.9
    k = s.next_k(1000)
    assert (k > 0) == spec or plain is None
    assert s.plain_rounds(limit) == want


def _plain_pays(ring_s: float | None = None) -> SpecStats:
    """An estimator whose costs say plain decoding pays (a draft token dearer than ten steps)."""
    s = SpecStats()
    s.step_s, s.extra_s, s.draft_s, s.ring_s = 0.1, 0.01, 1.0, ring_s
    return s


def test_plain_rounds_end_at_a_probe() -> None:
    s = _plain_pays()
    given = []
    for _ in range(6):
        k = s.next_k(1000)
        given.append(s.plain_rounds(1000) if k == 0 else -k)
    # ring runs up to each probe (K=2 here), and probes grow rarer while they confirm plain
    assert given == [7, -2, 15, -2, 31, -2]


def test_probe_interval_stops_growing_at_its_cap() -> None:
    s = _plain_pays()
    s.probe_every_max = 16
    given = []
    for _ in range(8):
        k = s.next_k(1000)
        given.append(s.plain_rounds(1000) if k == 0 else -k)
    assert given == [7, -2, 15, -2, 15, -2, 15, -2]


@pytest.mark.parametrize(("catch_up_s", "first_probe"), [(0.0, 7), (0.5, 500), (2.0, 2000)])
def test_a_dear_probe_pushes_the_next_one_back(catch_up_s: float, first_probe: int) -> None:
    """A probe whose draft model first caught up on a long context cost ``catch_up_s``: the next
    probe waits until plain decoding has run that over PROBE_BUDGET (1%), in time, not rounds."""
    s = _plain_pays(ring_s=0.1)  # 0.1 s a token
    s.charge_probe(catch_up_s)
    ks = []
    for _ in range(first_probe + 50):
        k = s.next_k(10**6)
        ks.append(k)
        if k == 0:
            s.observe_yield(False, 1, 0.1)
    assert ks.index(2) == pytest.approx(first_probe, abs=2)
    s2 = _plain_pays(ring_s=0.1)
    s2.charge_probe(catch_up_s)
    assert s2.next_k(10**6) == 0
    assert s2.plain_rounds(10**6) == pytest.approx(max(first_probe, 7), abs=2)  # what runs round the ring first


# (case, plain tok/s, speculative tok/s, new tokens, draft prefill s, prefill the draft?)
PREFILL_PAYS = [
    ("WAN: 64 tokens repay a 3 s prefill", 1.86, 3.26, 64, 3.0, True),
    ("WAN: 8 tokens do not", 1.86, 3.26, 8, 3.0, False),
    ("one node: a 9% gain does not repay it", 7.07, 7.7, 64, 3.0, False),
    ("one node: a long answer does", 7.07, 7.7, 512, 3.0, True),
    ("speculation slower than plain", 5.0, 4.0, 10**6, 0.0, False),
]


@pytest.mark.parametrize(
    ("case", "plain", "spec", "tokens", "prefill_s", "want"), PREFILL_PAYS, ids=[c[0] for c in PREFILL_PAYS]
)
def test_prefill_pays(case: str, plain: float, spec: float, tokens: int, prefill_s: float, want: bool) -> None:
    assert prefill_pays(plain, spec, tokens, prefill_s) is want


WAN20 = SpecCosts(acceptance=0.5, draft_s=0.0, step_s=0.147, extra_s=0.010, plain_s=0.113)  # measured, lookup
NO_RING = SpecCosts(acceptance=0.5, draft_s=0.0, step_s=0.147, extra_s=0.010)
# (case, costs, drafts, confidence in all of them, a round pays?)
MATCH_ROUNDS = [
    ("no match: the ring beats a plain step through the coordinator", WAN20, 0, 1.0, False),
    ("a sure 8-token copy", WAN20, 8, 0.9, True),
    ("a unigram guess", WAN20, 1, 0.19, False),
    ("a likely pair", WAN20, 2, 0.5, True),
    ("16 drafts, each a coin toss", WAN20, 16, 0.5**16, False),
    ("ring not timed yet: a plain step is all there is", NO_RING, 0, 1.0, True),
    ("ring not timed yet: any drafts", NO_RING, 3, 0.01, True),
]


@pytest.mark.parametrize(("case", "c", "n", "conf", "want"), MATCH_ROUNDS, ids=[m[0] for m in MATCH_ROUNDS])
def test_match_round_pays(case: str, c: SpecCosts, n: int, conf: float, want: bool) -> None:
    assert match_round_pays(c, n, conf) is want


def test_match_bar_prices_a_draft_against_a_ring_token() -> None:
    assert match_bar(WAN20) == pytest.approx(0.010 / 0.113)
    assert match_bar(NO_RING) == pytest.approx(0.010 / 0.147)  # no ring timed: a plain step
    wan100 = SpecCosts(acceptance=0.5, draft_s=0.0, step_s=0.428, extra_s=0.010, plain_s=0.303)
    assert match_bar(wan100) < match_bar(WAN20)  # a dearer token: longer proposals
    dear = SpecCosts(acceptance=0.5, draft_s=0.0, step_s=0.05, extra_s=0.2, plain_s=0.05)
    assert match_bar(dear) == MAX_THRESHOLD


def test_draft_pays_learns_the_prefill_from_long_warm_prompts() -> None:
    s = SpecStats()
    s.step_s, s.extra_s, s.draft_s, s.acceptance = 0.1, 0.01, 0.0, 0.9  # drafts free and good
    assert s.draft_pays(200, 64)  # nothing timed: prefill, and time it
    s.observe_prefill(200, 30.0)  # the first prefill (a cold model): not taken
    s.observe_prefill(8, 8.0)  # a short prompt: mostly fixed cost, not taken per token
    assert s.prefill_s is None and s.draft_pays(200, 64)
    s.observe_prefill(200, 2.0)  # 10 ms a prompt token
    assert s.prefill_s == pytest.approx(0.01)
    assert s.draft_pays(200, 64)  # ~0.07 s saved a token x 64 > 2 s
    assert not s.draft_pays(200, 16)  # x 16 < 2 s
    assert not s.draft_pays(2000, 64)  # a long prompt: 20 s
    for _ in range(3):  # the rounds deliver little over plain: the promise is not believed
        s.observe_yield(True, 11, 1.0)
    assert not s.draft_pays(200, 64)


# (case, wait after the target's prefill, target alone, target beside the draft: s a prompt
# token; what the draft's prefill adds, s a prompt token)
PREFILL_ADDED = [
    ("a ring of other machines: the draft is done first", 0.0, 0.020, 0.020, 0.0),
    ("the draft outlasts the target's prefill", 0.003, 0.010, 0.010, 0.003),
    ("a shared node: the target slowed by the draft", 0.0, 0.010, 0.014, 0.004),
    ("slowed and then waited for", 0.002, 0.010, 0.014, 0.006),
    ("beside faster than alone (noise): no credit", 0.0, 0.010, 0.009, 0.0),
]


@pytest.mark.parametrize(("case", "wait", "alone", "beside", "want"), PREFILL_ADDED, ids=[c[0] for c in PREFILL_ADDED])
def test_prefill_added(case: str, wait: float, alone: float, beside: float, want: float) -> None:
    assert prefill_added(wait, alone, beside) == pytest.approx(want)


def _wan_stats() -> SpecStats:
    """A 100 ms/hop ring's costs (measured): plain 2.1 tok/s, speculation about 3 tok/s."""
    s = SpecStats()
    s.step_s, s.extra_s, s.draft_s, s.acceptance, s.ring_s = 0.48, 0.05, 0.06, 0.8, 0.40
    s.observe_prefill(200, 30.0, waited=0.0)  # the first prefill (a cold model): not taken
    return s


def test_a_draft_prefill_hidden_by_the_network_is_not_charged() -> None:
    s = _wan_stats()
    s.observe_prefill(200, 4.0, waited=0.0)  # 20 ms a token, all of it while the target prefilled
    assert s.prefill_cost(200) == pytest.approx(4.0)  # the target's prefill not timed: all of it
    assert not s.draft_pays(200, 16)
    for _ in range(3):  # the first timing is not taken (a cold pipeline)
        s.observe_target_prefill(200, 6.0, beside_draft=False)
    assert s.prefill_cost(200) == pytest.approx(4.0)  # not yet timed beside the draft
    s.observe_target_prefill(200, 6.0, beside_draft=True)  # no slower with the draft beside it
    assert s.prefill_cost(200) == pytest.approx(0.0)
    assert s.draft_pays(200, 16)  # nothing to repay: even a short request speculates
    s.observe_prefill(200, 4.0, waited=0.5)  # a request that waited for the draft
    assert 0.0 < s.prefill_cost(200) < 0.5


def test_a_draft_prefill_that_slows_the_target_is_charged() -> None:
    s = _wan_stats()
    s.observe_prefill(200, 4.0, waited=0.0)
    for beside, seconds in ((False, 6.0), (False, 6.0), (True, 10.0)):
        s.observe_target_prefill(200, seconds, beside_draft=beside)
    assert s.prefill_cost(200) == pytest.approx(4.0)  # the target ran 4 s slower beside the draft
    assert not s.draft_pays(200, 16)
    assert s.draft_pays(200, 64)


def test_a_cold_draft_models_first_timing_is_not_taken() -> None:
    s = SpecStats()
    s.observe_step(1, 0.15)  # a plain step timed; nothing known about drafting
    assert s.next_k(1000) >= 2  # so try it
    s.observe_draft(2 * 0.047, 2)  # the draft model's first proposal: cold, ten times slower
    s.observe_accept(2, 2)
    s.observe_step(3, 0.17)
    assert s.draft_s is None
    s.observe_draft(2 * 0.004, 2)  # warm
    assert s.draft_s == pytest.approx(0.004)
    assert s.next_k(1000) > 0  # cheap, well-accepted drafts over 150 ms steps: speculate
