"""The monolithic reference (the stand-in for one laptop): ``python -m coordinator.bench.mono_worker JOB_JSON``.

Start it pinned (``taskset``) so OpenVINO's CPU plugin sees only its cores. It loads the whole
model, warms it up and prints ``{"ready": true}``; then each line on stdin (``{"tokens": N}``)
runs one generation of the prompt and is answered with one JSON line of its tok/s, measured
like the pipeline rows (tokens / wall time, prefill included). The bench asks for a run right
after each pipeline run, so the two are measured side by side on the same machine state.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    job = json.loads(sys.argv[1])
    from agent.runtime.chain import Chain

    chain = Chain.load(job["export_dir"], device=job.get("device", "CPU"), threads=job["threads"])
    streams = chain.open_streams()
    prompt = job["prompt"]
    chain.generate(prompt, max_tokens=8, streams=streams)  # warm-up: first inferences allocate
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        tokens = int(json.loads(line)["tokens"])
        t0 = time.perf_counter()
        g = chain.generate(prompt, max_tokens=tokens, streams=streams)
        print(json.dumps({"tok_s": len(g.tokens) / (time.perf_counter() - t0)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
