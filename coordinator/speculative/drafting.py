"""Drafters: cheap guesses of the next K tokens, checked by the target pipeline.

* :class:`LookupDrafter` (prompt lookup): finds the most recent earlier occurrence of the
  context's last n-gram and proposes what followed it. No model, no cost; strong when the
  answer repeats its input (code edits, quoting). It learns from the target's verdicts how
  far to trust a match of each n-gram length (:class:`LookupStats`).
* :class:`ModelDrafter`: a small model with the target's tokenizer, run as a whole-model
  stateful IR on the coordinator. Each stream has its own InferRequest; tokens the target
  rejected are rolled back by the attention mask, exactly as on the target's stages. With
  ``lookup_first`` (``--draft NAME+lookup``) a long prompt-lookup match is proposed instead of
  running the model: free drafts while the answer copies its input, the model elsewhere.

A drafter hands out one :class:`DraftSession` per stream. ``propose`` is blocking (it may
run inference): call it off the event loop. A draft model also says how sure it is: after a
proposal, ``confidence`` is the product of its probabilities for the drafted tokens (a
stand-in for the chance that the target accepts them all), and ``propose`` stops early once
that product falls below ``min_conf``: long drafts where the text is predictable, short ones
where it is not.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from agent.models.store import LocalModel


class DraftSession(Protocol):
    confidence: float | None  # of the last proposal: product of the drafts' probabilities; None = unknown
    caught_up: int  # context tokens the last proposal first had to feed (a draft behind the stream)
    last_proposal: object  # what the drafter needs to learn from the last proposal's verdict

    def propose(self, context: Sequence[int], k: int, min_conf: float = 0.0) -> list[int]:
        """Up to ``k`` tokens likely to follow ``context`` (all tokens so far, prompt included);
        fewer once the drafter's confidence in all of them drops below ``min_conf``."""
        ...

    def verified(self, proposal: object, proposed: int, accepted: int) -> None:
        """The target accepted the first ``accepted`` of a proposal's ``proposed`` tokens
        (``proposal``: that proposal's ``last_proposal``)."""
        ...

    def close(self) -> None: ...


class Drafter(Protocol):
    name: str

    def session(self) -> DraftSession: ...


# ---- prompt lookup --------------------------------------------------------------------------


class LookupStats:
    """How well prompt lookup's drafts fare, by the length of the n-gram they matched.

    Each drafted token is taken to be accepted with probability ``q`` once the ones before it
    were (a geometric run), ``q`` estimated per n-gram length as accepted tokens / (accepted
    tokens + proposals cut short by a rejection), from a prior of one each (``q`` = 0.5). A
    unigram match in prose is a poor guess; a trigram inside copied code a good one: the
    drafter proposes as many tokens as stay likely enough, and none where no match is.
    """

    def __init__(self, max_ngram: int) -> None:
        self._acc = [1.0] * (max_ngram + 1)
        self._cut = [1.0] * (max_ngram + 1)
        self._lock = threading.Lock()

    def q(self, g: int) -> float:
        return self._acc[g] / (self._acc[g] + self._cut[g])

    def observe(self, g: int, proposed: int, accepted: int) -> None:
        with self._lock:
            self._acc[g] += accepted
            self._cut[g] += 1 if accepted < proposed else 0


def likely_prefix(n: int, q: float, min_conf: float) -> int:
    """How many of ``n`` tokens, each accepted with probability ``q`` given the ones before,
    keep the chance that all are accepted (``q ** j``) at or above ``min_conf``."""
    if min_conf <= 0.0 or q >= 1.0:
        return n
    if q <= 0.0 or min_conf > 1.0:
        return 0
    j = 0
    p = 1.0
    while j < n and p * q >= min_conf:
        p *= q
        j += 1
    return j


class LookupSession:
    """Per-stream n-gram index over the context, extended as the context grows."""

    def __init__(self, max_ngram: int, min_ngram: int, stats: LookupStats | None = None) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.stats = stats or LookupStats(max_ngram)
        self._ctx: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest continuation starts
        self._indexed = 0  # n-grams ending before this position are indexed
        self.confidence: float | None = None
        self.caught_up = 0
        self.last_proposal: object = None  # the length of the n-gram the last proposal matched

    def _sync(self, context: Sequence[int]) -> None:
        n = len(context)
        common = min(len(self._ctx), n)
        if self._ctx[:common] != list(context[:common]):  # not an extension: start over
            self._ctx, self._index, self._indexed = [], {}, 0
        self._ctx = list(context)
        # index every n-gram ending at j for j <= n-2 (the tail n-gram must match an earlier one)
        for j in range(self._indexed, n - 1):
            for g in range(self.min_ngram, self.max_ngram + 1):
                if j - g + 1 >= 0:
                    self._index[tuple(self._ctx[j - g + 1 : j + 1])] = j + 1
        self._indexed = max(self._indexed, n - 1)

    def propose(self, context: Sequence[int], k: int, min_conf: float = 0.0) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching tail n-gram:
        up to ``k`` tokens, as many as that n-gram length's record makes likely enough."""
        self.confidence, self.last_proposal = None, None
        if k <= 0 or not context:
            return []
        self._sync(context)
        n = len(self._ctx)
        for g in range(min(self.max_ngram, n), self.min_ngram - 1, -1):
            start = self._index.get(tuple(self._ctx[n - g :]))
            if start is not None:
                q = self.stats.q(g)
                out = self._ctx[start : start + k]
                out = out[: likely_prefix(len(out), q, min_conf)]
                self.confidence, self.last_proposal = q ** len(out), g
                return out
        return []

    def verified(self, proposal: object, proposed: int, accepted: int) -> None:
        if isinstance(proposal, int) and proposed > 0:
            self.stats.observe(proposal, proposed, accepted)

    def close(self) -> None:
        self._ctx, self._index = [], {}


class LookupDrafter:
    name = "lookup"
    self_bounded = True  # free proposals, cut short by their own record (LookupStats)

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not (1 <= min_ngram <= max_ngram):
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.stats = LookupStats(max_ngram)  # shared by every stream: what this model's answers look like

    def session(self) -> LookupSession:
        return LookupSession(self.max_ngram, self.min_ngram, self.stats)


# ---- draft model ----------------------------------------------------------------------------


class ModelSession:
    """One stream of the draft model: the tokens its KV holds, rolled back by mask."""

    def __init__(self, drafter: ModelDrafter) -> None:
        from agent.runtime.stage import Stream

        self._d = drafter
        self._lookup = LookupSession(3, 3) if drafter.lookup_first else None
        self._stream: Stream = drafter.stage.open_stream()
        self._stream.reset()
        self._fed: list[int] = []  # tokens whose KV slots are live, in order
        self.confidence: float | None = None
        self.caught_up = 0
        self.last_proposal: object = None

    def _feed(self, ids: Sequence[int]) -> tuple[int, float]:
        """Feed ``ids``; the draft's next token and its probability."""
        out = self._d.stage.forward(self._stream, np.asarray(ids, dtype=np.int64)[None, :])
        self._fed.extend(ids)
        assert out.token_ids is not None and out.logits is not None
        return int(out.token_ids[-1]), top_probability(out.logits[-1])

    def prefill(self, prompt: Sequence[int]) -> None:
        """Feed the prompt ahead of the first proposal (while the target prefills it too)."""
        if prompt and not self._fed:
            self._feed(prompt)

    def propose(self, context: Sequence[int], k: int, min_conf: float = 0.0) -> list[int]:
        self.confidence, self.caught_up = None, 0
        if k <= 0 or not context:
            return []
        if self._lookup is not None:
            found = self._lookup.propose(context, k)
            if len(found) == k:  # a trigram match with k tokens after it: trust the copy
                return found
        common = 0
        limit = min(len(self._fed), len(context) - 1)  # always feed at least the last token
        while common < limit and self._fed[common] == context[common]:
            common += 1
        drop = len(self._fed) - common
        if drop:
            self._stream.rollback(drop)
            self._stream.maybe_compact()
            del self._fed[common:]
        self.caught_up = len(context) - common
        tok, conf = self._feed(context[common:])
        out = [tok]
        while len(out) < k and conf >= min_conf:
            tok, p = self._feed([out[-1]])
            out.append(tok)
            conf *= p
        self.confidence = conf
        return out

    def verified(self, proposal: object, proposed: int, accepted: int) -> None:
        """The draft model needs no verdicts: its confidence is its own probabilities."""

    def close(self) -> None:
        self._fed = []


def top_probability(logits: np.ndarray) -> float:
    """The softmax probability of the largest logit."""
    x = logits.astype(np.float32, copy=False)
    return float(1.0 / np.exp(x - x.max()).sum())


class ModelDrafter:
    """A whole-model (1-stage) stateful IR of a draft model with the target's tokenizer."""

    def __init__(
        self, stage_dir: Path, name: str, *, device: str = "CPU", threads: int | None = None, lookup_first: bool = False
    ) -> None:
        from agent.runtime.stage import Stage

        self.name = name
        self.lookup_first = lookup_first
        self.stage = Stage(stage_dir, device=device, threads=threads)
        if not (self.stage.first and self.stage.last):
            raise ValueError(f"the draft must be a whole-model (1-stage) export, got {stage_dir}")
        self._lock = threading.Lock()

    def session(self) -> ModelSession:
        with self._lock:
            return ModelSession(self)


# ---- set-up ---------------------------------------------------------------------------------


def same_tokenizer(a: Path, b: Path) -> bool:
    """Whether two tokenizer directories map text to the same ids (vocabulary and added tokens)."""
    import json

    def ids(d: Path) -> tuple[object, object]:
        t = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
        added = sorted((x["id"], x["content"]) for x in t.get("added_tokens", []))
        return t.get("model", {}).get("vocab"), added

    try:
        return ids(a) == ids(b)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def load_drafter(
    ref: str, target: LocalModel, *, weights: str, device: str = "CPU", threads: int | None = None, quiet: bool = True
) -> Drafter:
    """``lookup``, or a model (name or path) whose tokenizer is the target's, exported whole;
    ``NAME+lookup``: that model, with prompt lookup tried first."""
    if ref == "lookup":
        return LookupDrafter()
    lookup_first = ref.endswith("+lookup")
    ref = ref.removesuffix("+lookup")
    from agent.export.exporter import ExportOptions, export_model
    from agent.models.store import ModelStore

    draft = ModelStore().resolve(ref, quiet=quiet)
    if not same_tokenizer(draft.tokenizer_dir, target.tokenizer_dir):
        raise ValueError(
            f"the draft {draft.name} does not share {target.name}'s tokenizer: pick a draft of the same family, "
            "or --draft lookup"
        )
    res = export_model(draft, [(0, draft.num_layers)], ExportOptions(weights=weights), quiet=quiet)
    name = f"{draft.name}/{weights}" + ("+lookup" if lookup_first else "")
    return ModelDrafter(res.stage_dirs()[0], name, device=device, threads=threads, lookup_first=lookup_first)
