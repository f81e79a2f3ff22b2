"""Shared fixtures: the real SmolLM2 model (pulled once into the user cache) and its exports."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_REPORTS: list[str] = []

warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=".*non-writable.*")


def report(line: str) -> None:
    """A figure worth seeing after the run (printed in the terminal summary)."""
    _REPORTS.append(line)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _REPORTS:
        terminalreporter.section("lakeshard figures")
        for line in _REPORTS:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def smollm2():  # type: ignore[no-untyped-def]
    from agent.models.store import ModelStore

    return ModelStore().resolve("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def export_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("exports")


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


@pytest.fixture
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private LAKESHARD_HOME (empty model store, config and logs)."""
    home = tmp_path / "home"
    monkeypatch.setenv("LAKESHARD_HOME", str(home))
    yield home


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):  # type: ignore[no-untyped-def]
    """The Hugging Face torch model loaded from the same GGUF (the reference implementation)."""
    import torch
    from transformers import AutoModelForCausalLM

    ck = smollm2.checkpoint
    model = AutoModelForCausalLM.from_pretrained(str(ck.parent), gguf_file=ck.name, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):  # type: ignore[no-untyped-def]
    from agent.runtime.tokenizer import ChatTokenizer

    return ChatTokenizer(smollm2.tokenizer_dir, smollm2.dir / "config.json")


PROMPTS = [
    "What is the capital of France? Tell me about the city.",
    "Write a short Python function that checks whether a number is prime.",
    "List three tips for staying focused while working from home.",
]


@pytest.fixture(scope="session")
def int4_exports(smollm2, export_root: Path) -> dict[int, Path]:  # type: ignore[no-untyped-def]
    out = {}
    for n in (1, 2):
        d = export_root / f"int4-{n}"
        r = run_cli("export", "smollm2-135m", "--stages", str(n), "--weights", "int4", "--out", str(d))
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"stage {n - 1}:" in r.stdout
        out[n] = d
    return out
