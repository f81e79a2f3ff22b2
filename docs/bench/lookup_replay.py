"""Offline replay of prompt lookup on the target's own greedy answers (not part of the suite).

    .venv/bin/python docs/bench/lookup_replay.py

Generates 160 greedy tokens of Qwen2.5-Coder-1.5B (INT4, whole model, 2 threads) for each
``bench spec`` prompt, then replays speculative rounds against them: at each round the
lookup drafter proposes up to K tokens, the longest matching prefix is accepted plus one
token. Prints tokens per round, drafts per round and acceptance for full proposals (K = 4,
8, 16) and for the learned, confidence-bounded proposals at a fixed bar.
"""

from __future__ import annotations

import os

from agent.bench.spec_prompts import PROMPTS
from agent.export.exporter import ExportOptions, export_model
from agent.models.store import ModelStore
from agent.runtime.chain import Chain
from agent.runtime.tokenizer import ChatTokenizer
from coordinator.drafting import LookupDrafter


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


def main() -> None:
    model = ModelStore().resolve("qwen2.5-coder-1.5b")
    res = export_model(model, [(0, model.num_layers)], ExportOptions(weights="int4"))
    tok = ChatTokenizer(res.dir / "tokenizer")
    chain = Chain.load(res.dir, device="CPU", threads=min(2, os.cpu_count() or 1))
    for name, prompts in PROMPTS.items():
        items = []
        for p in prompts:
            ids = tok.chat_ids([{"role": "user", "content": p}])
            items.append((ids, chain.generate(ids, max_tokens=160).tokens))
        for k in (4, 8, 16):
            print(f"{name}: full proposals, K={k}: {replay(items, k, 0.0, False)}")
        for bar in (0.06, 0.14):
            print(f"{name}: learned, K=16, bar {bar}: {replay(items, 16, bar, True)}")


if __name__ == "__main__":
    main()
