"""``lakeshard bench batching``: GenAI's continuous batching and our clusters, one JSON line."""

from __future__ import annotations

import json

from tests.support.cli import run_cli
from tests.support.figures import report

CONFIGS = {"genai", "stage1", "stage2", "stage2_per_stream"}


def test_bench_batching_reports_every_config_and_user_count(smollm2) -> None:  # type: ignore[no-untyped-def]
    r = run_cli(
        "bench", "batching", "--model", "smollm2-135m", "--weights", "int8",
        "--users", "1,2", "--tokens", "8", "--runs", "1", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {(row["config"], row["users"]) for row in out["rows"]} == {(c, u) for c in CONFIGS for u in (1, 2)}
    for row in out["rows"]:
        assert row["tok_s"] > 0 and row["late_ttft_s"] > 0
        assert 0 < row["itl_p50_ms"] <= row["itl_p95_ms"]
    for key in ("stage1_vs_genai", "stage2_vs_genai", "stage2_per_stream_vs_genai"):
        assert set(out[key]) == {"1", "2"}
        assert set(out["spread"][key]) == {"1", "2"}
    assert out["runs"] == 1 and isinstance(out["outputs_identical"], bool)
    # no configuration's answers change with the number of users (1 and 2 stages may differ:
    # the default wire carries f16 hidden states)
    assert all(out["batch_dependent"][c] == [] for c in CONFIGS - {"genai"}), out["batch_dependent"]
    report(f"bench batching (smollm2, 8 tokens): stage2 / genai {out['stage2_vs_genai']}")
