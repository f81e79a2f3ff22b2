"""Offline replay of prompt lookup on the target's own greedy answers (not part of the suite).

    .venv/bin/python docs/bench/lookup_replay.py

Generates 160 greedy tokens of Qwen2.5-Coder-1.5B (INT4, whole model, 2 threads) for each
``bench spec`` prompt, then replays speculative rounds against them: at each round the
lookup drafter proposes up to K tokens, the longest matching prefix is accepted plus one
token. Prints tokens per round, drafts per round and acceptance for full proposals (K = 4,
8, 16) and for the learned, confidence-bounded proposals at a fixed bar; then the same for the
first 64 tokens (what ``bench spec --tokens 64`` times) beside an oracle: a copying drafter that
knows, each round, which position of the context to copy from for the longest accepted run.
No drafter that copies from the context can beat the oracle's tokens per round.
"""

from __future__ import annotations

import os

from agent.export.exporter import ExportOptions, export_model
from agent.models.store import ModelStore
from agent.runtime.chain import Chain
from agent.runtime.tokenizer import ChatTokenizer
from coordinator.bench.spec_prompts import PROMPTS
from coordinator.speculative.drafting import LookupDrafter


def replay(items: list[tuple[list[int], list[int]]], k: int, bar: float, learn: bool) -> str:
    d = LookupDrafter()
    rounds = toks = drafted = 0
    for prompt, out in items:
        s = d.session()
        i = 0
        while i < len(out):
            prop = s.propose(prompt + out[:i], k, bar)
            a = 0
            while a < len(prop) and i + a < len(out) and out[i + a] == prop[a]:
                a += 1
            if learn and prop:
                s.verified(s.last_proposal, len(prop), a)
            rounds, drafted, toks, i = rounds + 1, drafted + len(prop), toks + a + 1, i + a + 1
    acc = (toks - rounds) / max(drafted, 1)
    return f"tokens/round {toks / rounds:.2f}, drafts/round {drafted / rounds:.2f}, acceptance {acc:.2f}"


def oracle(items: list[tuple[list[int], list[int]]], k: int) -> str:
    rounds = toks = 0
    for prompt, out in items:
        i = 0
        while i < len(out):
            ctx = prompt + out[:i]
            best = 0
            for s in range(len(ctx)):
                a = 0
                while a < k and s + a < len(ctx) and i + a < len(out) and ctx[s + a] == out[i + a]:
                    a += 1
                best = max(best, a)
            rounds, toks, i = rounds + 1, toks + best + 1, i + best + 1
    return f"tokens/round {toks / rounds:.2f}"


def answers(sets: list[str], tokens: int = 160) -> dict[str, list[tuple[list[int], list[int]]]]:
    """(prompt ids, the target's greedy answer) for each prompt of each named ``bench spec`` set."""
    model = ModelStore().resolve("qwen2.5-coder-1.5b")
    res = export_model(model, [(0, model.num_layers)], ExportOptions(weights="int4"))
    tok = ChatTokenizer(res.dir / "tokenizer")
    chain = Chain.load(res.dir, device="CPU", threads=min(2, os.cpu_count() or 1))
    out: dict[str, list[tuple[list[int], list[int]]]] = {}
    for name in sets:
        out[name] = []
        for p in PROMPTS[name]:
            ids = tok.chat_ids([{"role": "user", "content": p}])
            out[name].append((ids, chain.generate(ids, max_tokens=tokens).tokens))
    return out


def main() -> None:
    for name, items in answers(list(PROMPTS)).items():
        for k in (4, 8, 16):
            print(f"{name}: full proposals, K={k}: {replay(items, k, 0.0, False)}")
        for bar in (0.06, 0.14):
            print(f"{name}: learned, K=16, bar {bar}: {replay(items, 16, bar, True)}")
        first = [(p, out[:64]) for p, out in items]
        for k in (8, 16):
            full, best = replay(first, k, 0.0, False), oracle(first, k)
            print(f"{name}, first 64 tokens, K={k}: full proposals {full}; oracle {best}")


if __name__ == "__main__":
    main()
