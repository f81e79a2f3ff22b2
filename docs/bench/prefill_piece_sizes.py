"""What a prefill piece's size costs per token: the whole Qwen2.5-Coder-0.5B INT4 IR in one
process, a 512-token prompt fed in pieces of 512 down to 32 tokens, twice each.

    taskset -c 1 python docs/bench/prefill_piece_sizes.py
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from agent.runtime.chain import Chain
from coordinator.bench.pipeline import synthetic_ids

PROMPT = 512


def prefill(chain: Chain, ids: np.ndarray, piece: int) -> tuple[float, list[float]]:
    streams = chain.open_streams()
    t0 = time.perf_counter()
    per = []
    for o in range(0, PROMPT, piece):
        t1 = time.perf_counter()
        chain.forward(streams, ids[None, o : o + piece])
        per.append(time.perf_counter() - t1)
    return time.perf_counter() - t0, per


def main() -> None:
    export = sorted(Path.home().glob(".cache/lakeshard/exports/qwen2.5-coder-0.5b-*/int4-g128-0-24"))[0]
    chain = Chain.load(export, device="CPU", threads=1)
    ids = np.array(synthetic_ids(PROMPT), dtype=np.int64)
    prefill(chain, ids, PROMPT)  # warm-up: first inferences allocate
    prefill(chain, ids, 64)
    for _ in range(2):
        for piece in (512, 256, 128, 64, 32):
            total, per = prefill(chain, ids, piece)
            print(
                f"piece {piece:3d}: total {total * 1000:6.0f} ms; first / last piece {per[0] * 1000:.0f} / "
                f"{per[-1] * 1000:.0f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
