"""One answer's generation, as the API sees it: the text deltas of the tokens the scheduler yields,
cut at the stop strings, with its figures (time to the first token, rate, speculation), and, when
asked, each token's log-probabilities, sent with the text in which the token's own begins (a token
past a stop string's start is not part of the answer, nor are its log-probabilities)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from agent.protocol import SamplingSpec
from coordinator.api.logprobs import Scored
from coordinator.api.state import ApiState
from coordinator.batching.scheduler import GenRequest
from coordinator.speculative.decoding import SpecCounters


class StopMatcher:
    """Cuts the text at the first stop string; holds back what could still become one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, delta: str) -> str:
        self.text += delta
        for s in self.stops:
            i = self.text.find(s)
            if i >= 0:
                self.stopped = True
                out = self.text[self.sent : i]
                self.sent = i
                return out
        safe = len(self.text) - self.hold if self.stops else len(self.text)
        out = self.text[self.sent : max(self.sent, safe)]
        self.sent += len(out)
        return out

    def flush(self) -> str:
        if self.stopped:
            return ""
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out


@dataclass
class Tally:
    """One answer's figures: what the client is told (``lakeshard`` field) and the event stream."""

    stream: str
    t0: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    spec: SpecCounters = field(default_factory=SpecCounters)  # this answer's speculation
    ids: list[int] = field(default_factory=list)  # the tokens generated, in order
    continued: int = 0  # tokens a lost coordinator generated before this one went on

    @property
    def completion(self) -> int:
        return self.continued + self.tokens

    def token(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens += 1

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else round(self.first - self.t0, 4)

    @property
    def tok_s(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2 or self.last <= self.first:
            return None
        return round((self.tokens - 1) / (self.last - self.first), 2)

    def report(self, nodes: list[str]) -> dict[str, Any]:
        spec = self.spec.summary() if self.spec.rounds or self.spec.ring_tokens else None
        return {
            "ttft_s": self.ttft_s,
            "tok_s": self.tok_s,
            "completion_tokens": self.completion,
            "nodes": nodes,
            "speculation": spec,  # None: this answer was decoded plainly
        }


@dataclass(frozen=True)
class Piece:
    """What an answer has to say next: a text delta, the finish reason (once, at the end), and the
    log-probabilities of the tokens whose text begins in what has been said with it (when asked)."""

    text: str
    finish: str | None = None
    scored: tuple[Scored, ...] = ()


class Held:
    """Tokens with their log-probabilities, held until the text they begin in is sent."""

    def __init__(self) -> None:
        self.tokens: list[Scored] = []

    def before(self, limit: float) -> tuple[Scored, ...]:
        """The held tokens whose text begins before character ``limit`` (no longer held)."""
        out = tuple(s for s in self.tokens if s.offset < limit)
        self.tokens = self.tokens[len(out) :]
        return out


async def tokens(st: ApiState, ids: list[int], opts: dict[str, Any], tally: Tally) -> AsyncGenerator[Piece, None]:
    """The answer's pieces (see :class:`Piece`). ``opts["logprobs"]`` (alternatives a token, or
    None) asks for log-probabilities: the tokens a lost coordinator generated before this one went
    on (``continue``) have none here (its client was sent them)."""
    cont: tuple[int, ...] = opts.get("continue", ())
    want: int | None = opts.get("logprobs")
    req = GenRequest(
        prompt=(*ids, *cont),
        max_tokens=opts["max_tokens"] - len(cont),
        sampling=SamplingSpec(opts["temperature"], opts["top_p"], opts["seed"], want),
        stop_ids=st.tokenizer.stop_ids,
        spec_counters=tally.spec,
        logprobs=[] if want is not None else None,
    )
    dec = st.tokenizer.stream()
    stop = StopMatcher(opts["stop"])
    held = Held()
    n = len(cont)
    for tok in cont:  # the text so far, as the lost coordinator had it; the client has ``sent`` of it
        stop.push(dec.push(tok))
    stop.sent = min(opts.get("sent", 0), len(stop.text))
    if stop.stopped or n >= opts["max_tokens"] or (cont and cont[-1] in req.stop_ids):
        yield Piece("", "stop" if n < opts["max_tokens"] else "length")
        return
    gen = st.scheduler.async_generate(req)
    try:
        async for tok in gen:
            n += 1
            tally.token()
            tally.ids.append(tok)
            if req.logprobs is not None:  # (the scheduler keeps a token's before it yields it)
                held.tokens.append(Scored(tok, req.logprobs[tally.tokens - 1], len(stop.text)))
            piece = stop.push(dec.push(tok))
            if piece:
                yield Piece(piece, None, held.before(stop.sent))
            if stop.stopped:
                yield Piece("", "stop", held.before(stop.sent))
                return
    finally:
        await gen.aclose()
    tail = stop.flush()
    if tail:
        yield Piece(tail, None, held.before(stop.sent))
    yield Piece("", "length" if n >= opts["max_tokens"] else "stop", held.before(float("inf")))
