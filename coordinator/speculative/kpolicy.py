"""How many tokens to draft per round: a pure function of measured costs, and their estimator.

A speculative round drafts K tokens, then verifies the pending token plus the K drafts in one
pass through the pipeline (K+1 positions). With a per-token acceptance probability ``a`` the
round yields ``1 + a + a^2 + ... + a^K`` tokens (the accepted prefix plus one correction),
and costs ``K * draft_s + step_s + K * extra_s``: the draft's time, one pipeline round (its
compute and every network hop) and the extra compute of K more positions per step. A plain
step yields one token for ``step_s``. K is the one that maximises tokens per second, and 0
when no K beats plain by a margin: on a compute-bound CPU with a costly draft, speculation
does not pay; over a WAN, where the round trip dominates ``step_s``, a long K does.

Nothing is assumed about the machine: :class:`SpecStats` learns every cost from the rounds
it observes, and keeps probing (rarely) the choice it is not making, so a change in load,
link or prompt moves K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

K_MAX = 16
MARGIN = 0.03  # speculate only when the model predicts at least this gain over plain
PROBE_BUDGET = 0.01  # share of plain decoding time that speculative probes' catch-up may cost
PROBE_EVERY_MAX = 256  # rounds: the longest interval between probes while a choice holds
PREFILL_MIN_TOKENS = 32  # shorter draft prefills are mostly fixed cost: not timed per token


@dataclass(frozen=True)
class SpecCosts:
    acceptance: float  # probability that the target accepts a drafted token (given the previous was)
    draft_s: float  # draft time per proposed token
    step_s: float  # round time of a plain 1-token step: compute on every stage + all hops
    extra_s: float  # added round time per additional verified position
    plain_s: float | None = None  # time per token of plain decoding round the ring (no coordinator hop)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens gained per round of K drafts: the accepted prefix plus one target token."""
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def tokens_per_s(c: SpecCosts, k: int) -> float:
    if k == 0 and c.plain_s is not None and c.plain_s > 0.0:
        return 1.0 / c.plain_s  # plain decoding runs round the ring, not through the coordinator
    return expected_tokens(c.acceptance, k) / (k * (c.draft_s + c.extra_s) + c.step_s)


def choose_k(c: SpecCosts, k_max: int = K_MAX, margin: float = MARGIN) -> int:
    """The K in 0..k_max with the best predicted tokens per second (0 = do not speculate)."""
    if c.step_s <= 0 or k_max < 1:
        return 0
    plain = tokens_per_s(c, 0)
    best_k, best = 0, plain * (1.0 + margin)
    for k in range(1, k_max + 1):
        r = tokens_per_s(c, k)
        if r > best * (1.0 + 1e-9):
            best_k, best = k, r
    return best_k


def prefill_pays(plain_rate: float, spec_rate: float, tokens: int, prefill_s: float) -> bool:
    """Whether a request of up to ``tokens`` new tokens repays the draft model's prefill of its
    prompt (``prefill_s`` seconds): speculating saves ``1/plain_rate - 1/spec_rate`` a token."""
    if spec_rate <= plain_rate or plain_rate <= 0.0:
        return False
    return tokens * (1.0 / plain_rate - 1.0 / spec_rate) > prefill_s


def prefill_added(wait_s: float, alone_s: float, beside_s: float) -> float:
    """What the draft's prefill adds to a request, per prompt token: the time the request waits
    for it after the target's prefill (``wait_s``), plus how much slower the target's prefill
    runs beside it (``beside_s``) than alone (``alone_s``). On a ring of other machines the
    draft prefills while the target's prefill crosses the network, and adds little; where the
    draft shares the target's cores, about its whole duration."""
    return wait_s + max(0.0, beside_s - alone_s)


MAX_THRESHOLD = 0.9  # never demand more certainty than this of a draft


def draft_threshold(c: SpecCosts, k: int) -> float:
    """How sure the draft must stay to go on drafting (see :mod:`coordinator.speculative.drafting`).

    One more draft costs ``draft_s + extra_s`` and is worth one token (``1 / tokens_per_s``
    seconds at the chosen K) if the target accepts it, which needs every draft before it
    accepted too: drafting goes on while that chance, estimated by the product of the draft's
    probabilities, exceeds the ratio. Over a WAN a token is dear and drafts are cheap, so the
    bar is low; on a compute-bound node it is high.
    """
    rate = tokens_per_s(c, max(k, 0))
    if rate <= 0.0:
        return 0.0
    return min(MAX_THRESHOLD, max(0.0, (c.draft_s + c.extra_s) * rate))


def match_bar(c: SpecCosts) -> float:
    """The confidence bar for a free, self-bounded drafter (prompt lookup) deciding each round
    on its own match: one more draft costs ``draft_s + extra_s`` and, if accepted, saves a plain
    token's time round the ring (``plain_s``; a plain step where the ring is not measured)."""
    token_s = c.plain_s if c.plain_s is not None and c.plain_s > 0.0 else c.step_s
    if token_s <= 0.0:
        return 0.0
    return min(MAX_THRESHOLD, max(0.0, (c.draft_s + c.extra_s) / token_s))


def match_round_pays(c: SpecCosts, n: int, confidence: float) -> bool:
    """Whether a round verifying ``n`` drafts, all accepted with probability ``confidence``
    (each one given the ones before with ``confidence ** (1/n)``), yields tokens faster than
    plain decoding round the ring. A plain step (no drafts) through the coordinator never
    beats the ring, which is measured; where the ring is not measured yet, any drafts pay."""
    if n <= 0:
        return c.plain_s is None
    if c.plain_s is None or c.plain_s <= 0.0:
        return True
    q = min(max(confidence, 0.0), 1.0) ** (1.0 / n)
    expected = float(sum(q**j for j in range(n + 1)))  # the round's own token plus the accepted drafts
    return expected / (c.step_s + n * (c.draft_s + c.extra_s)) > 1.0 / c.plain_s


def ahead_threshold(step_s: float, busy_s: float | None) -> float:
    """How likely the frames in flight must be to be accepted whole before drafting ahead of them.

    A frame drafted ahead keeps the stages busy while the frames before it travel: it gains
    the idle part of a round (``step_s - busy_s``, where ``busy_s`` is the bottleneck stage's
    compute) if they are accepted, and costs the bottleneck its compute if a rejection voids
    it. It pays when ``p * (step_s - busy_s) > (1 - p) * busy_s``, that is ``p > busy_s /
    step_s``: never on a compute-bound node, easily over a WAN. Unknown compute: no bar.
    """
    if busy_s is None or busy_s <= 0.0 or step_s <= 0.0:
        return 0.0
    return min(1.0, busy_s / step_s)


class SpecStats:
    """Running estimates of the costs in :class:`SpecCosts`, from observed rounds.

    Exponentially weighted, so they follow a changing machine or link. ``next_k`` applies
    :func:`choose_k` and, every so often, tries the other side (a plain step while
    speculating, a short speculative round while not) so that no estimate goes stale; the
    probing interval doubles while probes keep confirming the choice.
    """

    def __init__(
        self,
        *,
        k_max: int = K_MAX,
        decay: float = 0.85,
        acceptance: float = 0.6,
        probe_budget: float = PROBE_BUDGET,
        probe_every_max: int = PROBE_EVERY_MAX,
    ) -> None:
        self.k_max = k_max
        self.probe_budget = probe_budget
        self.probe_every_max = probe_every_max
        self.decay = decay
        self.acceptance = acceptance
        self.draft_s: float | None = None
        self.step_s: float | None = None
        self.extra_s: float | None = None
        self.busy_s: float | None = None  # the bottleneck stage's compute in a plain step
        self.ring_s: float | None = None  # time per token while plain decoding runs round the ring
        self._accepted = 4.0 * acceptance  # pseudo-counts for the acceptance estimate
        self._trials = 4.0
        self._probe_every = 8
        self._since_probe = 0
        # plain decoding time still to pass before a speculative probe: what the last probe's
        # catch-up cost, divided by the budget (a draft model behind by a whole context is dear)
        self.probe_debt_s = 0.0
        # realized output, per mode (plain / speculating): decayed tokens, seconds, observations
        self._yield: dict[bool, list[float]] = {False: [0.0, 0.0, 0.0], True: [0.0, 0.0, 0.0]}
        self._speculating = False
        self.last_k = 0
        self.prefill_s: float | None = None  # the draft model's prefill time per prompt token
        # per prompt token: how long a request waited for the draft's prefill once the target's
        # was done, and the target's own prefill with the draft's running beside it or not
        self.prefill_wait_s: float | None = None
        self.target_prefill_s: dict[bool, float | None] = {False: None, True: None}
        self._prefills = 0
        self._target_prefills = 0
        self._drafts = 0

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1.0 - self.decay) * new

    def observe_draft(self, seconds: float, proposed: int) -> None:
        """The draft proposed ``proposed`` tokens in ``seconds``. The first proposal of a new
        coordinator is not taken: a cold draft model's first inferences (measured: 47 ms a
        token against 4 ms warm) would keep the policy off speculation until its next probe."""
        if proposed <= 0:
            return
        self._drafts += 1
        if self._drafts > 1:
            self.draft_s = self._ewma(self.draft_s, max(seconds, 0.0) / proposed)

    def observe_step(self, positions: int, seconds: float, busy_s: float = 0.0) -> None:
        """A pipeline round of ``positions`` verified positions took ``seconds``, of which the
        busiest stage computed ``busy_s`` (0: not reported)."""
        if positions <= 1:
            self.step_s = self._ewma(self.step_s, seconds)
            if busy_s > 0.0:
                self.busy_s = self._ewma(self.busy_s, min(busy_s, seconds))
        elif self.step_s is not None:
            per = max(seconds - self.step_s, 0.0) / (positions - 1)
            self.extra_s = self._ewma(self.extra_s, per)

    def observe_ring(self, seconds: float) -> None:
        """One token of plain decoding round the ring (no coordinator hop) took ``seconds``."""
        self.ring_s = self._ewma(self.ring_s, max(seconds, 0.0))

    def observe_accept(self, proposed: int, accepted: int) -> None:
        """``accepted`` of ``proposed`` drafts matched (a rejection ends the round)."""
        if proposed <= 0:
            return
        rejected = 1.0 if accepted < proposed else 0.0
        self._accepted = self.decay * self._accepted + accepted
        self._trials = self.decay * self._trials + accepted + rejected
        self.acceptance = self._accepted / self._trials if self._trials > 0 else 0.0

    def observe_yield(self, speculative: bool, tokens: int, seconds: float) -> None:
        """A stream got ``tokens`` in ``seconds`` (since its previous result), by a speculative
        round or a plain step: what the policy's choice really delivered, every cost included."""
        t, s, n = self._yield[speculative]
        self._yield[speculative] = [self.decay * t + tokens, self.decay * s + max(seconds, 0.0), n + 1]
        if not speculative:
            self.probe_debt_s = max(0.0, self.probe_debt_s - max(seconds, 0.0))

    def observe_prefill(self, tokens: int, seconds: float, waited: float | None = None) -> None:
        """The draft model prefilled a ``tokens``-token prompt in ``seconds``, and the request
        then waited ``waited`` seconds for it after the target's prefill was done. The first
        prefill (a cold model) and short ones (mostly fixed cost) are not taken per token."""
        self._prefills += 1
        if self._prefills > 1 and tokens >= PREFILL_MIN_TOKENS:
            self.prefill_s = self._ewma(self.prefill_s, max(seconds, 0.0) / tokens)
            if waited is not None:
                self.prefill_wait_s = self._ewma(self.prefill_wait_s, max(waited, 0.0) / tokens)

    def observe_target_prefill(self, tokens: int, seconds: float, beside_draft: bool) -> None:
        """The pipeline prefilled a ``tokens``-token prompt in ``seconds`` (to its first token),
        with the draft model prefilling the same prompt beside it or not. The first (a cold
        pipeline) and short ones are not taken."""
        self._target_prefills += 1
        if self._target_prefills > 1 and tokens >= PREFILL_MIN_TOKENS:
            old = self.target_prefill_s[beside_draft]
            self.target_prefill_s[beside_draft] = self._ewma(old, max(seconds, 0.0) / tokens)

    def prefill_cost(self, prompt_len: int) -> float | None:
        """What the draft's prefill of a ``prompt_len``-token prompt adds to a request: the wait
        for it after the target's prefill, plus what running beside the target slowed the
        target's down by (where they share cores). Its whole duration until the target's
        prefill is timed both with and without it; None until it is timed at all."""
        if self.prefill_s is None:
            return None
        alone, beside = self.target_prefill_s[False], self.target_prefill_s[True]
        per = self.prefill_s
        if self.prefill_wait_s is not None and alone is not None and beside is not None:
            per = min(per, prefill_added(self.prefill_wait_s, alone, beside))
        return per * prompt_len

    def draft_pays(self, prompt_len: int, max_tokens: int) -> bool:
        """While the policy speculates: whether a new request of ``prompt_len`` prompt tokens and
        up to ``max_tokens`` new ones repays what the draft's prefill of its prompt adds
        (:meth:`prefill_cost`), at the rate speculation delivers (the model's promise, or the
        rounds' record where lower) against plain decoding's. True until a prefill is timed."""
        c = self.costs()
        cost = self.prefill_cost(prompt_len)
        if c is None or cost is None:
            return True
        k = choose_k(c, min(self.k_max, max(max_tokens - 1, 0)))
        if k == 0:
            return False
        spec = tokens_per_s(c, k)
        realized = self.realized_rate(True)
        if realized is not None:
            spec = min(spec, realized)
        return prefill_pays(tokens_per_s(c, 0), spec, max_tokens, cost)

    def charge_probe(self, seconds: float) -> None:
        """A probe's draft first spent ``seconds`` catching up on the plain rounds before it: the
        next probe waits until plain decoding has run ``seconds / probe_budget``, so probing
        costs at most that share of the time whatever the draft model and context length."""
        self.probe_debt_s = max(self.probe_debt_s, max(seconds, 0.0) / self.probe_budget)

    def realized_rate(self, speculative: bool, min_obs: int = 3) -> float | None:
        """Tokens per second delivered while speculating (or not); None until observed enough."""
        t, s, n = self._yield[speculative]
        return t / s if n >= min_obs and s > 0.0 else None

    def costs(self) -> SpecCosts | None:
        if self.step_s is None:
            return None
        extra = self.extra_s if self.extra_s is not None else 0.3 * self.step_s
        return SpecCosts(self.acceptance, self.draft_s or 0.0, self.step_s, extra, self.ring_s)

    @property
    def speculating(self) -> bool:
        """Whether the policy's current choice is to speculate (probes aside)."""
        return self._speculating

    def plain_rounds(self, limit: int) -> int:
        """Right after :meth:`next_k` chose plain (not as a probe): how many plain rounds, this
        one included and at most ``limit``, come before the policy next looks at speculation.
        They are taken now, so they can run round the ring without the coordinator; 1 where
        the next round must be the coordinator's (a plain probe while speculating)."""
        if self._speculating or self.last_k != 0 or self.step_s is None or limit <= 1:
            return 1
        due = self._probe_every - self._since_probe
        if self.probe_debt_s > 0.0:  # and until the last probe's catch-up is paid for
            per = self.ring_s or self.step_s
            due = max(due, math.ceil(self.probe_debt_s / per))
        n = max(1, min(limit, due))
        self._since_probe += n - 1
        return n

    def ahead_bar(self) -> float:
        """:func:`ahead_threshold` at the current estimates."""
        return ahead_threshold(self.step_s or 0.0, self.busy_s)

    def threshold(self, k: int) -> float:
        """:func:`draft_threshold` at the current estimates (0 until a plain step is timed)."""
        c = self.costs()
        return draft_threshold(c, k) if c is not None and k > 0 else 0.0

    def next_k(self, remaining: int) -> int:
        """K for the next round, with ``remaining`` tokens still wanted."""
        cap = min(self.k_max, max(remaining - 1, 0))
        if cap < 1:
            return 0
        c = self.costs()
        if c is None:
            return 0  # first measure a plain step
        k = choose_k(c, cap)
        if self.extra_s is None or self.draft_s is None:
            k = max(k, min(2, cap))  # nothing measured about speculation yet: try it once
        spec_rate, plain_rate = self.realized_rate(True), self.realized_rate(False)
        if k > 0 and spec_rate is not None and plain_rate is not None and spec_rate < plain_rate * (1.0 - MARGIN):
            k = 0  # the model promises a gain that the rounds do not deliver: believe the rounds
        if (k > 0) != self._speculating:
            self._speculating = k > 0
            # the choice flipped: watch closely again. A plain probe while speculating gives up a
            # whole round's worth of tokens, a short speculative probe costs little: probe
            # plain less often.
            self._probe_every, self._since_probe = (32 if k > 0 else 8), 0
        self._since_probe += 1
        if k > 0 and self._yield[False][2] < 3:
            self._probe_every = min(self._probe_every, 4)  # speculating unchecked: time plain soon
        if self._since_probe >= self._probe_every and (k > 0 or self.probe_debt_s <= 0.0):
            # try the other side once; probe less often while the choice holds
            self._since_probe = 0
            self._probe_every = min(self._probe_every * 2, self.probe_every_max)
            k = 0 if k > 0 else min(2, cap)
        self.last_k = k
        return k
