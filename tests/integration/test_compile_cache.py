"""OpenVINO's compiled-model cache stays under its cap, dropping the least recently used blobs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.runtime.device import DeviceError, cache_cap_bytes, prune_compiled_cache
from tests.support.cli import REPO

MB = 2**20


def _blob(d: Path, name: str, size_mb: int, used_at: float) -> Path:
    f = d / name
    f.write_bytes(bytes(size_mb * MB))
    os.utime(f, (used_at, used_at))
    return f


@pytest.mark.parametrize(
    ("sizes_mb", "cap_mb", "left"),
    [
        ([3, 3, 3], 10, {"b0", "b1", "b2"}),  # under the cap: nothing goes
        ([3, 3, 3], 6, {"b1", "b2"}),  # the oldest goes first
        ([3, 3, 3], 5, {"b2"}),
        ([3, 3, 3], 0, set()),  # cap 0: a cache that keeps nothing
        ([8, 1, 1], 3, {"b1", "b2"}),  # one big old blob frees enough
    ],
)
def test_prune_keeps_the_most_recently_used(tmp_path: Path, sizes_mb: list[int], cap_mb: int, left: set[str]) -> None:
    for i, s in enumerate(sizes_mb):
        _blob(tmp_path, f"b{i}", s, 1_000_000 + i * 100)
    prune_compiled_cache(tmp_path, cap_mb * MB)
    assert {p.name for p in tmp_path.iterdir()} == left


def test_cap_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAKESHARD_COMPILE_CACHE_MB", "2.5")
    assert cache_cap_bytes() == int(2.5 * MB)
    monkeypatch.setenv("LAKESHARD_COMPILE_CACHE_MB", "lots")
    with pytest.raises(DeviceError, match="LAKESHARD_COMPILE_CACHE_MB"):
        cache_cap_bytes()


COMPILE = """
import sys
from agent.runtime.stage import Stage
Stage(sys.argv[1], device="CPU", threads=1)
"""


def _compile_in_child(stage: Path, home: Path, cap_mb: str) -> Path:
    env = {**os.environ, "LAKESHARD_HOME": str(home), "LAKESHARD_COMPILE_CACHE_MB": cap_mb}
    r = subprocess.run([sys.executable, "-c", COMPILE, str(stage)], env=env, cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return home / "cache" / "ov-compiled"


def test_a_real_compile_fills_the_cache_only_up_to_the_cap(int4_exports: dict[int, Path], tmp_path: Path) -> None:
    stage = int4_exports[1] / "stage_0"
    cache = _compile_in_child(stage, tmp_path / "roomy", "4096")
    roomy = sum(f.stat().st_size for f in cache.iterdir())
    assert roomy > 1 * MB  # the compiled model was kept for the next start
    cache = _compile_in_child(stage, tmp_path / "tight", "1")
    assert sum(f.stat().st_size for f in cache.iterdir()) <= 1 * MB
