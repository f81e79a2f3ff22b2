"""Where each stage of a ring idles, from ``LAKESHARD_FRAME_TRACE`` files (any streams).

    LAKESHARD_FRAME_TRACE=/tmp/tr lakeshard bench pipeline --stages 2 --streams 2 ... --json
    python docs/bench/stage_idle.py /tmp/tr

Per agent: its steps' compute time (median, percentiles), and every idle stretch between two
steps, split into "the next frame had already arrived" (pure overhead) and "waiting for the
next frame"; then, per run (steps separated by more than 300 ms of silence), each agent's busy
share of the run's wall time; then the idle stretches over 3 ms, in order, with the step before
and after (prefills included: a prefill step is the long one of a new stream).
"""

from __future__ import annotations

import itertools
import statistics as st
import sys
from pathlib import Path

from hop_trace import load  # the sibling script: run this one as docs/bench/stage_idle.py

Step = tuple[int, int, tuple[str, int], int]  # start, end, (stream, seq), received


def steps_of(folder: Path) -> list[tuple[str, list[Step]]]:
    """Each agent's steps in start order (the trace files as :func:`hop_trace.load` reads them)."""
    procs = []
    for p in load(folder):
        ev = p.ev
        keys = set(ev["recv"]) & set(ev["start"]) & set(ev["end"]) & set(ev["done"])
        steps = sorted((ev["start"][k], ev["end"][k], k, ev["recv"][k]) for k in keys)
        if steps:
            procs.append((p.name, steps))
    return procs


def main(folder: Path) -> None:
    procs = steps_of(folder)
    t0 = min(steps[0][0] for _, steps in procs)
    for name, steps in procs:
        comp = [(b - a) / 1e6 for a, b, _, _ in steps]
        queued, waiting = [], []
        for x, y in itertools.pairwise(steps):
            gap = (y[0] - x[1]) / 1e6
            if gap < 300:
                (queued if y[3] <= x[1] else waiting).append(gap)
        q = st.quantiles(comp, n=20)
        print(
            f"{name}: {len(steps)} steps, compute p10 {q[1]:.1f} p50 {q[9]:.1f} p90 {q[17]:.1f} ms; idle with the "
            f"next frame there: {len(queued)} x, {sum(queued):.0f} ms; waiting for it: {len(waiting)} x, "
            f"median {st.median(waiting) if waiting else 0:.2f} ms, {sum(waiting):.0f} ms"
        )
    every = sorted((a, b, i) for i, (_, steps) in enumerate(procs) for a, b, _, _ in steps)
    runs, cur = [], [every[0]]
    for x in every[1:]:
        if x[0] - max(y[1] for y in cur) > 300e6:
            runs.append(cur)
            cur = []
        cur.append(x)
    runs.append(cur)
    for r in runs:
        wall = (max(b for _, b, _ in r) - min(a for a, _, _ in r)) / 1e6
        busy = [sum(b - a for a, b, j in r if j == i) / 1e6 for i in range(len(procs))]
        print(f"run of {len(r)} steps: wall {wall:.0f} ms, busy {[f'{x:.0f} ms ({x / wall:.0%})' for x in busy]}")
    for name, steps in procs:
        print(name)
        for x, y in itertools.pairwise(steps):
            gap = (y[0] - x[1]) / 1e6
            if 3 < gap < 2000:
                print(
                    f"  idle {gap:6.1f} ms at {(x[1] - t0) / 1e9:7.3f} s, after {x[2][0][:4]}#{x[2][1]} "
                    f"({(x[1] - x[0]) / 1e6:.0f} ms), before {y[2][0][:4]}#{y[2][1]} (its frame came "
                    f"{(y[3] - x[1]) / 1e6:+.1f} ms after)"
                )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
