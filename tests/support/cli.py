"""The repository's root, and the real ``lakeshard`` console entry point run in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run the real ``lakeshard`` console entry point in a child process."""
    e = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        capture_output=True,
        text=True,
        env=e,
        timeout=timeout,
        cwd=REPO,
    )
