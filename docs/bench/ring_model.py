"""An event model of a 2-stage ring with S streams, to see what bounds ``bench pipeline``'s 2x2.

    python docs/bench/ring_model.py

Each stage runs one step at a time, in arrival order (as an agent's compute thread does). A
stream's prompt goes in ``pieces`` frames, all sent at once; each later token is one decode
step through stage 0 then stage 1, and the last stage hands the token straight back to stage 0
(the ring loop). Times are the medians of a frame trace of the real 2x2 run on the 2-core VM
(`pipeline_2x_c1_short_prompt_pieces.log`, `docs/bench/stage_idle.py`): prefill pieces of 24
tokens 200 ms on stage 0 (16 layers) and 115 ms on stage 1 (8 layers and the head), decode
steps 20.2 and 21.4 ms, and 0.9 ms a hop (what makes the traced 43.4 ms a round of both
streams out of 41.6 ms of steps). The monolithic reference is one stream after the other:
577 ms to the first token, then 41.2 ms a token. With those figures the model gives 1.738x
against 1.726x measured; then it varies one thing at a time.
"""

from __future__ import annotations

import heapq
import itertools

MONO_TTFT, MONO_STEP = 577.0, 41.2
PRE0, PRE1, DEC0, DEC1 = 200.0, 115.0, 20.2, 21.4  # traced: prefill piece and decode step, ms
LAYERS0, LAYERS = 16, 24  # stage 0's layers, all layers
Frame = tuple[int, bool, int]  # stream, prefill?, piece or token index


def ring(
    *,
    pre0: float = PRE0,
    pre1: float = PRE1,
    dec0: float = DEC0,
    dec1: float = DEC1,
    hop: float = 0.9,
    pieces: int = 2,
    tokens: int = 64,
    streams: int = 2,
    decode_first: bool = False,
) -> float:
    """Wall time (ms) until every stream has ``tokens`` tokens. ``decode_first``: a stage picks
    a waiting decode step before a waiting prefill piece (else it runs frames as they came)."""
    seq = itertools.count()
    events: list[tuple[float, int, str, int, Frame]] = []  # (time, order, kind, stage, frame)
    waiting: list[list[tuple[float, int, Frame]]] = [[], []]
    for s in range(streams):
        for p in range(pieces):
            heapq.heappush(events, (0.0, next(seq), "arrive", 0, (s, True, p)))
    busy = [False, False]
    got = [0] * streams
    end = 0.0

    def start(stage: int, now: float) -> None:
        if busy[stage] or not waiting[stage]:
            return
        key = (lambda w: (w[2][1], w[0], w[1])) if decode_first else (lambda w: (w[0], w[1]))
        w = min(waiting[stage], key=key)
        waiting[stage].remove(w)
        frame = w[2]
        cost = (pre0 if frame[1] else dec0) if stage == 0 else (pre1 if frame[1] else dec1)
        busy[stage] = True
        heapq.heappush(events, (now + cost, next(seq), "done", stage, frame))

    while events:
        now, order, kind, stage, frame = heapq.heappop(events)
        if kind == "arrive":
            waiting[stage].append((now, order, frame))
        else:
            busy[stage] = False
            s, prefill, idx = frame
            if stage == 0:
                heapq.heappush(events, (now + hop, next(seq), "arrive", 1, frame))
            elif not prefill or idx == pieces - 1:  # a token
                got[s] += 1
                end = max(end, now + hop)
                if got[s] < tokens:
                    heapq.heappush(events, (now + hop, next(seq), "arrive", 0, (s, False, got[s])))
        start(stage, now)
        start(1 - stage, now)
    return end


def ratio(**kw: float) -> float:
    streams, tokens = int(kw.get("streams", 2)), int(kw.get("tokens", 64))
    mono = streams * (MONO_TTFT + (tokens - 1) * MONO_STEP)
    return mono / ring(**kw)  # type: ignore[arg-type]


def main() -> None:
    cases: list[tuple[str, dict[str, float]]] = [
        ("as traced", {}),
        ("hops free", {"hop": 0.0}),
        ("stage 1 as fast as stage 0", {"dec1": DEC0}),
        ("prefill split evenly (165 / 150 ms a piece)", {"pre0": 165.0, "pre1": 150.0}),
        ("decode steps ahead of prefill pieces", {"decode_first": True}),
        ("one prefill frame", {"pieces": 1, "pre0": 390.0, "pre1": 215.0}),
        ("3 streams", {"streams": 3}),
        ("128-token answers", {"tokens": 128}),
    ]
    # move layers between the stages: a layer costs what stage 0's cost per layer says
    dec_layer, pre_layer = DEC0 / LAYERS0, PRE0 / LAYERS0
    for n0 in (17, 15):
        moved = LAYERS0 - n0  # to stage 1
        shifted = {"dec0": DEC0 - moved * dec_layer, "dec1": DEC1 + moved * dec_layer}
        shifted |= {"pre0": PRE0 - moved * pre_layer, "pre1": PRE1 + moved * pre_layer}
        cases.append((f"{n0}/{LAYERS - n0} layers", shifted))
    for name, kw in cases:
        print(f"{name:48s} {ring(**kw):7.0f} ms  {ratio(**kw):.3f}x")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
