"""OpenVINO GenAI's continuous batching, the reference of ``lakeshard bench batching``:
``python -m coordinator.bench.genai_worker JOB_JSON``.

Start it pinned (``taskset``) so OpenVINO's CPU plugin sees only its cores. It loads our
whole-model ``--genai`` export into ``openvino_genai.ContinuousBatchingPipeline`` (the
PagedAttention backend ``LLMPipeline(ATTENTION_BACKEND="PA")`` runs, with its default scheduler:
dynamic split-fuse, 256 tokens a step) with the compile properties our stages get, warms it
up and prints ``{"ready": true}``. Then each line on stdin is one job, answered with one line:

- ``{"op": "batch", "prompts": [[ids]], "tokens": N}``: every prompt at once, N greedy tokens
  each; answers each one's ``tokens`` and ``stamps`` (seconds from the first request to each
  token's arrival, read after every step);
- ``{"op": "late", "prompts": [[ids]], "after": K, "budget": B}``: all prompts but the last
  start (B tokens each); once each has K tokens, the last arrives; answers its ``ttft``
  (seconds from its request to its first token), then every request is cancelled.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np


def _config(tokens: int) -> Any:
    import openvino_genai as ovg

    cfg = ovg.GenerationConfig()
    cfg.max_new_tokens = tokens
    cfg.min_new_tokens = tokens
    cfg.ignore_eos = True
    cfg.do_sample = False
    return cfg


class Runner:
    def __init__(self, job: dict[str, Any]) -> None:
        import openvino_genai as ovg

        from agent.runtime.device_profile import compile_properties

        device = str(job.get("device", "CPU"))
        props = compile_properties(device, threads=int(job["threads"]), exact=bool(job.get("exact", False)))
        self.props = {k: str(v) for k, v in props.items()}
        self.pipe = ovg.ContinuousBatchingPipeline(job["export_dir"], ovg.SchedulerConfig(), device, props)
        self.next_id = 0

    def add(self, prompt: list[int], tokens: int) -> Any:
        import openvino as ov

        self.next_id += 1
        ids = ov.Tensor(np.asarray([prompt], dtype=np.int64))
        return self.pipe.add_request(self.next_id, ids, _config(tokens))

    def step(self, handles: list[Any], made: list[list[int]], stamps: list[list[float]], t0: float) -> None:
        """One scheduler step; what each request produced is appended to ``made`` (and its arrival time)."""
        self.pipe.step()
        now = time.perf_counter() - t0
        for h, toks, st in zip(handles, made, stamps, strict=False):  # the late user may not be in yet
            if h.can_read():
                for out in h.read().values():
                    new = [int(t) for t in out.generated_ids]
                    toks += new
                    st += [now] * len(new)

    def batch(self, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
        made: list[list[int]] = [[] for _ in prompts]
        stamps: list[list[float]] = [[] for _ in prompts]
        t0 = time.perf_counter()
        handles = [self.add(p, tokens) for p in prompts]
        while self.pipe.has_non_finished_requests():
            self.step(handles, made, stamps, t0)
        return {"tokens": made, "stamps": stamps}

    def late(self, prompts: list[list[int]], after: int, budget: int) -> dict[str, Any]:
        made: list[list[int]] = [[] for _ in prompts]
        stamps: list[list[float]] = [[] for _ in prompts]
        t0 = time.perf_counter()
        handles = [self.add(p, budget) for p in prompts[:-1]]
        while any(len(m) < after for m in made[:-1]):
            self.step(handles, made, stamps, t0)
        t_late = time.perf_counter() - t0
        handles.append(self.add(prompts[-1], budget))
        while not made[-1]:
            self.step(handles, made, stamps, t0)
        for h in handles:
            h.cancel()
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
        return {"ttft": stamps[-1][0] - t_late}


def main() -> int:
    job = json.loads(sys.argv[1])
    runner = Runner(job)
    runner.batch([list(job["warmup"])] * 2, 8)  # first inferences allocate
    print(json.dumps({"ready": True, "props": runner.props}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "batch":
            res = runner.batch(msg["prompts"], int(msg["tokens"]))
        else:
            res = runner.late(msg["prompts"], int(msg["after"]), int(msg["budget"]))
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
