"""One monolithic run (the stand-in for one laptop): ``python -m agent.bench.mono_worker JOB_JSON``.

Start it pinned (``taskset``) so OpenVINO's CPU plugin sees only its cores. Prints one JSON
line: the median aggregate tok/s over the runs, measured like the pipeline rows.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main() -> int:
    job = json.loads(sys.argv[1])
    from agent.runtime.chain import Chain

    chain = Chain.load(job["export_dir"], device="CPU", threads=job["threads"])
    streams = chain.open_streams()
    prompt = job["prompt"]
    chain.generate(prompt, max_tokens=8, streams=streams)  # warm-up
    speeds = []
    for _ in range(job["runs"]):
        t0 = time.perf_counter()
        g = chain.generate(prompt, max_tokens=job["tokens"], streams=streams)
        speeds.append(len(g.tokens) / (time.perf_counter() - t0))
    print(json.dumps({"tok_s": statistics.median(speeds), "runs": speeds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
