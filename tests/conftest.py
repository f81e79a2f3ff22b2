"""Shared fixtures: the real SmolLM2 model (pulled once into the user cache) and its exports.

Only fixtures and pytest's hooks live here; the helpers they use, and that tests import, are in
tests/support/ (no test module imports this file or another test module)."""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import REPO, run_cli
from tests.support.served import Served

# every process the suite starts keeps OpenVINO's compiled-model cache small (CI disks are)
os.environ.setdefault("LAKESHARD_COMPILE_CACHE_MB", "512")
# Qt widgets are tested offscreen (the real tray host test starts its own X server)
os.environ["QT_QPA_PLATFORM"] = "offscreen"
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=".*non-writable.*")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The layers: tests/unit runs in seconds (``make test-fast``); tests/integration (real sockets,
    processes and models on this machine) and tests/system (whole clusters, the tray on an X
    server, network namespaces, installers) are marked slow."""
    for item in items:
        if "unit" not in item.path.relative_to(REPO / "tests").parts[:1]:
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests.support.figures import LINES

    if LINES:
        terminalreporter.section("lakeshard figures")
        for line in LINES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def smollm2():  # type: ignore[no-untyped-def]
    from agent.models.store import ModelStore

    return ModelStore().resolve("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def export_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("exports")


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


@pytest.fixture(scope="session")
def served3(smollm2) -> Iterator[Served]:  # type: ignore[no-untyped-def]
    """3 agents + coordinator, f32 activations and wire (exactly comparable), INT8 weights; the
    last stage always splits a lone stream's head with stage 0 (SmolLM2's head is too small for
    that to pay on every machine, so ``auto`` might not), so every test here covers that path.
    Stateful stages (the head split, and the per-stream path these tests name, are theirs)."""
    s = Served(
        3,
        *("--model", "smollm2-135m", "--weights", "int8", "--exact", "--streams", "4"),
        agent_args=["--head-help", "on", "--attention", "stateful"],
    )
    yield s
    s.stop()


@pytest.fixture(scope="session")
def whole_int8(smollm2, export_root: Path):  # type: ignore[no-untyped-def]
    """The whole-model INT8 IR as a 1-stage chain with f32 activations: the reference."""
    from agent.export.exporter import ExportOptions, export_model
    from agent.runtime.chain import Chain

    res = export_model(smollm2, [(0, smollm2.num_layers)], ExportOptions(weights="int8"), quiet=True)
    return Chain.load(res.dir, device="CPU", exact=True)


@pytest.fixture(scope="module")
def qloop(qapp):  # type: ignore[no-untyped-def]
    import qasync

    loop = qasync.QEventLoop(qapp)
    asyncio.set_event_loop(loop)
    yield loop
    loop.close()
    asyncio.set_event_loop(None)
