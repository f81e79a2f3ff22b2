"""Drafters: prompt lookup (pure) and the draft model with its own mask rollback."""

from __future__ import annotations

import pytest

from coordinator.speculative.decoding import accept
from coordinator.speculative.drafting import LookupDrafter, ModelDrafter, likely_prefix, load_drafter


@pytest.mark.parametrize(
    ("context", "k", "want"),
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),  # trigram seen before: what followed it
        ([1, 2, 3, 4, 5, 9, 2, 3], 2, [4, 5]),  # bigram
        ([7, 8, 9, 7], 5, [8, 9, 7]),  # unigram; the continuation runs to the end of the context
        ([1, 2, 3, 4], 3, []),  # nothing repeats
        ([5, 6, 1, 2, 5, 6, 3, 4, 5, 6], 2, [3, 4]),  # the most recent occurrence wins
        ([1, 2, 1, 2], 0, []),
    ],
)
def test_lookup_proposals(context: list[int], k: int, want: list[int]) -> None:
    assert LookupDrafter().session().propose(context, k) == want


def test_lookup_follows_a_growing_context() -> None:
    s = LookupDrafter().session()
    ctx = [10, 11, 12, 13]
    assert s.propose(ctx, 2) == []
    ctx += [10, 11]
    assert s.propose(ctx, 2) == [12, 13]
    ctx += [12, 99, 10]
    assert s.propose(ctx, 3) == [11, 12, 99]
    assert s.propose([10, 11, 10], 1) == [11]  # a different context: re-indexed from scratch


@pytest.mark.parametrize(
    ("n", "q", "min_conf", "want"),
    [
        (5, 0.5, 0.0, 5),  # no bar: everything the match offers
        (5, 0.9, 0.5, 5),  # 0.9 ** 5 = 0.59 stays above the bar
        (8, 0.9, 0.5, 6),  # 0.9 ** 6 = 0.53, 0.9 ** 7 = 0.48
        (5, 0.5, 0.3, 1),  # 0.5, then 0.25
        (5, 0.2, 0.3, 0),  # not even the first token is likely enough
        (3, 1.0, 0.9, 3),
        (0, 0.9, 0.5, 0),
    ],
)
def test_likely_prefix(n: int, q: float, min_conf: float, want: int) -> None:
    assert likely_prefix(n, q, min_conf) == want


def test_lookup_learns_which_matches_pay() -> None:
    """Verdicts teach the drafter, per matched n-gram length, how far to trust a copy: after
    unigram matches were always rejected and 4-gram ones always accepted, a unigram match
    proposes nothing under a bar of 0.3 while a 4-gram one proposes all it can."""
    d = LookupDrafter()
    s = d.session()
    uni = [7, 1, 2, 3, 9, 7]  # the tail 7 was seen once: a unigram match
    quad = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]  # the tail 1 2 3 4 was seen: a 4-gram match
    assert s.propose(uni, 3, 0.3) == [1]  # untried: q = 0.5, so one token clears 0.3
    assert s.last_proposal == 1 and s.confidence == pytest.approx(0.5)
    for _ in range(20):
        s.verified(1, 3, 0)
        s.verified(4, 3, 3)
    assert s.propose(uni, 3, 0.3) == []
    assert s.propose(quad, 4, 0.3) == [5, 6, 1, 2]
    assert s.last_proposal == 4 and s.confidence is not None and s.confidence > 0.8
    assert d.session().propose(uni, 3, 0.3) == []  # what one stream learned, the next one knows
    assert s.propose(uni, 3) == [1, 2, 3]  # no bar (a fixed K): the whole copy, as before


@pytest.mark.parametrize(
    ("drafts", "target", "n"),
    [([], [5], 0), ([1, 2, 3], [1, 2, 3, 4], 3), ([1, 2, 3], [1, 9, 3, 4], 1), ([1], [2, 3], 0)],
)
def test_accept_longest_matching_prefix(drafts: list[int], target: list[int], n: int) -> None:
    assert accept(drafts, target) == n


def test_draft_model_rolls_back_rejected_tokens(smollm2) -> None:  # type: ignore[no-untyped-def]
    drafter = load_drafter("smollm2-135m", smollm2, weights="int8")
    assert isinstance(drafter, ModelDrafter)
    prompt = [1, 504, 3458, 282, 4649, 314, 3840, 30]
    s = drafter.session()
    s.prefill(prompt)
    first = s.propose([*prompt, 378], 5)
    assert len(first) == 5
    # the target rejected everything after the second draft and chose 2313 instead
    ctx = [*prompt, 378, first[0], first[1], 2313]
    got = s.propose(ctx, 4)
    fresh = drafter.session()
    assert got == fresh.propose(ctx, 4)  # a session that never saw the rejected drafts
    assert s._stream.masked_slots() > 0  # rolled back by mask, not re-run


def test_draft_model_stops_when_unsure(smollm2) -> None:  # type: ignore[no-untyped-def]
    """The draft says how sure it is; with a bar it drafts only as far as it stays that sure."""
    drafter = load_drafter("smollm2-135m", smollm2, weights="int8")
    prompt = [1, 504, 3458, 282, 4649, 314, 3840, 30, 378]
    full = drafter.session()
    all8 = full.propose(prompt, 8)
    assert len(all8) == 8 and full.confidence is not None and 0.0 < full.confidence <= 1.0
    sure = drafter.session()
    assert sure.propose(prompt, 8, min_conf=1.01) == all8[:1]  # nothing is that sure: one draft
    bar = full.confidence**0.5  # somewhere inside this run's confidences
    part = drafter.session().propose(prompt, 8, min_conf=bar)
    assert 1 <= len(part) < 8 and part == all8[: len(part)]


def test_tokenizer_check_tells_a_changed_vocabulary(smollm2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from coordinator.speculative.drafting import same_tokenizer

    src = smollm2.tokenizer_dir
    assert same_tokenizer(src, src)
    t = json.loads((src / "tokenizer.json").read_text())
    vocab = t["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same words, different ids
    (tmp_path / "tokenizer.json").write_text(json.dumps(t))
    assert not same_tokenizer(src, tmp_path)
    assert not same_tokenizer(src, tmp_path / "missing")


def test_hybrid_drafter_proposes_a_copy_without_running_the_model(smollm2) -> None:  # type: ignore[no-untyped-def]
    drafter = load_drafter("smollm2-135m+lookup", smollm2, weights="int8")
    s = drafter.session()
    code = [1, 504, 3458, 282, 4649, 314, 3840, 30, 378]
    ctx = [*code, 2313, 77, 1, 504, 3458]  # the answer starts to repeat the code
    s.prefill(ctx[:-1])
    slots = s._stream.phys
    assert s.propose(ctx, 4) == [282, 4649, 314, 3840]
    assert s._stream.phys == slots  # the copy cost no inference
    got = s.propose([*ctx, 9999], 3)  # nothing to copy after an unseen token: the model drafts
    assert len(got) == 3 and s._stream.phys > slots
