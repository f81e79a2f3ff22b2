"""Offline replay: do other ways of choosing what to copy beat prompt lookup? (not in the suite)

    .venv/bin/python docs/bench/lookup_variants.py

Generates 160 greedy tokens of Qwen2.5-Coder-1.5B (INT4, whole model) for each ``bench spec``
code prompt (``lookup_replay.answers``), then replays full proposals of K tokens (the longest
matching prefix accepted, plus one token) for copy rules that differ in how the source is chosen:

* ``recent N``: the shipped ``LookupDrafter`` with ``max_ngram`` N (the latest earlier
  occurrence of the longest tail n-gram, n <= N), full proposals;
* ``follow N``: of the occurrences, the first one at or after where the last accepted copy ended
  (edits copy the source in order);
* ``vote N``: token by token, what most of the occurrences that still agree continue with.

Prints tokens per round for the first 64 tokens (what ``bench spec --tokens 64`` times) and for
all 160. 3x at 100 ms/hop (2 stages, 1 stream, coordinator on stage 0's node) needs about 4
tokens a round at K=8: there a K=8 round takes 1.3-1.4 plain tokens' time (lookup at K=8 gave
5.57 tok/s at ~2.35 tokens a round, i.e. ~420 ms a round, against 320 ms a plain token;
2026-12-03; the README's lookup paragraph).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from lookup_replay import answers  # beside this file (python puts the script's folder on the path)

from coordinator.speculative.drafting import LookupDrafter

Rule = Callable[[Sequence[int], int, dict[str, int]], list[int]]


def occurrences(ctx: Sequence[int], g: int) -> list[int]:
    """Where the continuation of each earlier occurrence of the last ``g`` tokens starts."""
    tail = tuple(ctx[len(ctx) - g :])
    return [j + 1 for j in range(g - 1, len(ctx) - 1) if tuple(ctx[j - g + 1 : j + 1]) == tail]


def longest(ctx: Sequence[int], max_ngram: int) -> list[int]:
    for g in range(min(max_ngram, len(ctx) - 1), 0, -1):
        found = occurrences(ctx, g)
        if found:
            return found
    return []


def recent(max_ngram: int) -> Rule:
    session = LookupDrafter(max_ngram=max_ngram).session()  # starts over on each new prompt

    def rule(ctx: Sequence[int], k: int, st: dict[str, int]) -> list[int]:
        return session.propose(ctx, k)

    return rule


def follow(max_ngram: int) -> Rule:
    def rule(ctx: Sequence[int], k: int, st: dict[str, int]) -> list[int]:
        found = longest(ctx, max_ngram)
        if not found:
            return []
        after = [s for s in found if "end" in st and s >= st["end"] - 1]
        st["src"] = min(after) if after else found[-1]
        return list(ctx[st["src"] : st["src"] + k])

    return rule


def vote(max_ngram: int) -> Rule:
    def rule(ctx: Sequence[int], k: int, st: dict[str, int]) -> list[int]:
        cands, out = longest(ctx, max_ngram), []
        for t in range(k):
            live = [s for s in cands if s + t < len(ctx)]
            if not live:
                break
            counts = Counter(ctx[s + t] for s in live)
            best = max(counts, key=lambda tok: (counts[tok], max(s for s in live if ctx[s + t] == tok)))
            out.append(best)
            cands = [s for s in live if ctx[s + t] == best]
        return out

    return rule


def replay(items: list[tuple[list[int], list[int]]], rule: Rule, k: int, first: int) -> float:
    rounds = toks = 0
    for prompt, answer in items:
        out, i, st = answer[:first], 0, {}
        while i < len(out):
            prop = rule(prompt + out[:i], k, st)
            a = 0
            while a < len(prop) and i + a < len(out) and out[i + a] == prop[a]:
                a += 1
            if prop and "src" in st:
                st["end"] = st["src"] + a
            rounds, toks, i = rounds + 1, toks + a + 1, i + a + 1
    return toks / rounds


def main() -> None:
    items = answers(["code"])["code"]
    rules = {
        f"{name} {n}": make(n)
        for name, make in (("recent", recent), ("follow", follow), ("vote", vote))
        for n in (4, 8)
    }
    for k in (8, 16):
        for name, rule in rules.items():
            first, whole = replay(items, rule, k, 64), replay(items, rule, k, 160)
            print(f"K={k} {name}: tokens/round, first 64 {first:.2f}, all 160 {whole:.2f}")


if __name__ == "__main__":
    main()
