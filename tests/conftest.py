"""Shared fixtures: the real SmolLM2 model (pulled once into the user cache) and its exports."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

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


class Served:
    """A real cluster: agent processes plus a ``lakeshard serve`` coordinator process."""

    def __init__(
        self,
        n: int,
        *extra: str,
        agent_env: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        agent_args: list[str] | None = None,
        agent_envs: list[dict[str, str]] | None = None,
        ports: list[int] | None = None,
        secure: bool = False,
    ) -> None:
        """``agent_envs``: one environment per agent over ``agent_env`` (e.g. its own LAKESHARD_HOME);
        ``ports``: the agents' data ports (default: free ones); ``secure``: TLS between the nodes,
        with the credentials in each process's home (default: plaintext, ``--insecure``)."""
        from coordinator.lab.local_cluster import LocalCluster, free_port

        self.cluster = LocalCluster(
            n, env=agent_env, agent_args=agent_args or (), agent_envs=agent_envs, ports=ports, secure=secure
        ).start()
        self.api_port = free_port()
        self.api_url = f"http://127.0.0.1:{self.api_port}"
        cmd = [sys.executable, "-m", "agent", "serve", "--nodes", ",".join(self.cluster.nodes)]
        cmd += ["--api-port", str(self.api_port), *extra, *(() if secure else ("--insecure",))]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
            cwd=REPO,
        )
        self.output: list[str] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("lakeshard: serving"):
                break
        else:
            self.stop()
            raise RuntimeError("coordinator did not start:\n" + "".join(self.output[-30:]))
        # keep draining its output so it can never block on a full pipe
        self.drained = threading.Thread(target=lambda: self.output.extend(self.proc.stdout or []), daemon=True)
        self.drained.start()

    @property
    def nodes(self) -> list[str]:
        return self.cluster.nodes

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.cluster.stop()


def post_chat(url: str, body: dict[str, Any], timeout: float = 300) -> tuple[int, dict[str, Any]]:
    """POST a chat completion to the coordinator API at ``url``: the status and the JSON body."""
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(served: Served, prompt: str, **kw: Any) -> str:
    """One user message through ``served``'s API; the reply's text (the request must succeed)."""
    status, body = post_chat(served.api_url, {"messages": [{"role": "user", "content": prompt}], **kw})
    assert status == 200, body
    return str(body["choices"][0]["message"]["content"])


@pytest.fixture(scope="session")
def served3(smollm2) -> Iterator[Served]:  # type: ignore[no-untyped-def]
    """3 agents + coordinator, f32 activations and wire (exactly comparable), INT8 weights; the
    last stage always splits a lone stream's head with stage 0 (SmolLM2's head is too small for
    that to pay on every machine, so ``auto`` might not), so every test here covers that path."""
    s = Served(
        3, "--model", "smollm2-135m", "--weights", "int8", "--exact", "--streams", "4", agent_args=["--head-help", "on"]
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


def exact_config(model: Any, nodes: list[str], term: int, **kw: Any) -> Any:
    """A coordinator config whose outputs compare token for token: INT8 weights, f32 all through."""
    from agent.export.exporter import ExportOptions
    from agent.security.transport import PLAINTEXT
    from coordinator.service.config import ServeConfig

    return ServeConfig(
        nodes=nodes,
        model=model,
        opts=ExportOptions(weights="int8"),
        transport=PLAINTEXT,  # the lab clusters of these tests are plaintext
        exact=True,
        wire_dtype="f32",
        api=False,
        quiet=True,
        term=term,
        **kw,
    )


@pytest.fixture(scope="module")
def qloop(qapp):  # type: ignore[no-untyped-def]
    import qasync

    loop = qasync.QEventLoop(qapp)
    asyncio.set_event_loop(loop)
    yield loop
    loop.close()
    asyncio.set_event_loop(None)
