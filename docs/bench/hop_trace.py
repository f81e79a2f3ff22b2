"""Per-hop breakdown of a ring pipeline's decode steps from ``LAKESHARD_FRAME_TRACE`` files.

    LAKESHARD_FRAME_TRACE=/tmp/tr lakeshard bench pipeline --stages 2 --streams 1 ... --json
    python docs/bench/hop_trace.py /tmp/tr

For one stream at a time (``--streams 1``): the stages are told apart by the order in which
the agents received each step. Per token, for each stage i (and the hop after it):
``queue`` (frame decoded on the event loop -> its step starts on the compute thread),
``compute``, ``hand`` (step done -> result on the event loop; includes encoding the frame),
``send`` (-> written to the next hop's websocket), ``net`` (-> decoded by the next stage; the
last stage's hop goes back to stage 0 with the stream's next step; with the head split, the
default for a lone stream, the last stage's ``compute`` spans its layers and its part of the
head and its ``hand`` the wait for stage 0's part: ``--head-help off`` for the plain ring).
Prints medians and means
in microseconds, then one JSON line. Prefill steps and the first step after each are left out.
"""

from __future__ import annotations

import bisect
import json
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

Key = tuple[str, int]
EVENTS = ("recv", "start", "end", "done")


@dataclass
class Proc:
    name: str = ""  # the trace file's name
    ev: dict[str, dict[Key, int]] = field(default_factory=lambda: defaultdict(dict))
    sent: list[int] = field(default_factory=list)


def load(folder: Path) -> list[Proc]:
    procs = []
    for f in sorted(folder.glob("frames-*.log")):
        p = Proc(f.name)
        for line in f.read_text().splitlines():
            t, kind, stream, seq = line.split()
            if kind == "sent":
                p.sent.append(int(t))
            else:
                p.ev[kind].setdefault((stream, int(seq)), int(t))
        p.sent.sort()
        if p.ev.get("recv"):  # an agent (the coordinator's file only has "sent")
            procs.append(p)
    return procs


def breakdown(procs: list[Proc]) -> dict[str, dict[str, float]]:
    keys = set.intersection(*(set(p.ev["recv"]) for p in procs))
    # the stages in ring order: the order in which most steps reached the agents
    orders = Counter(tuple(sorted(range(len(procs)), key=lambda i: procs[i].ev["recv"][k])) for k in keys)
    stages = [procs[i] for i in orders.most_common(1)[0][0]]
    comp: dict[str, list[float]] = defaultdict(list)
    for k in sorted(keys):
        nk = (k[0], k[1] + 1)
        if nk not in stages[0].ev["recv"] or (k[0], k[1] - 2) not in keys:  # a prefill step, or the one after
            continue
        row: dict[str, int] = {}
        for i, st in enumerate(stages):
            if any(k not in st.ev[e] for e in EVENTS):
                break
            done = st.ev["done"][k]
            j = bisect.bisect_left(st.sent, done)
            if j == len(st.sent):
                break
            nxt = stages[i + 1].ev["recv"][k] if i + 1 < len(stages) else stages[0].ev["recv"][nk]
            row |= {
                f"s{i}_queue": st.ev["start"][k] - st.ev["recv"][k],
                f"s{i}_compute": st.ev["end"][k] - st.ev["start"][k],
                f"s{i}_hand": done - st.ev["end"][k],
                f"s{i}_send": st.sent[j] - done,
                f"s{i}_net": nxt - st.sent[j],
            }
        else:
            row["token"] = stages[0].ev["recv"][nk] - stages[0].ev["recv"][k]
            for name, v in row.items():
                comp[name].append(v / 1000)
    if not comp:
        raise SystemExit("no decode steps found: trace a run with --streams 1")
    hops = [n for n in comp if not n.endswith("_compute") and n != "token"]
    comp["hops_total"] = [sum(comp[n][t] for n in hops) for t in range(len(comp["token"]))]
    return {n: {"p50": round(statistics.median(v), 1), "mean": round(statistics.mean(v), 1)} for n, v in comp.items()}


def main() -> None:
    procs = load(Path(sys.argv[1]))
    if len(procs) < 2:
        sys.exit("need the frame logs of at least two agents")
    out = breakdown(procs)
    for name, v in out.items():
        print(f"{name:12s} p50 {v['p50']:9.1f} us   mean {v['mean']:9.1f} us", file=sys.stderr)
    tokens = out["token"]["p50"]
    print(
        json.dumps(
            {
                "tokens_us": out["token"],
                "hops_us": out["hops_total"],
                "hops_share_p50": round(out["hops_total"]["p50"] / tokens, 4),
                "parts": out,
            }
        )
    )


if __name__ == "__main__":
    main()
