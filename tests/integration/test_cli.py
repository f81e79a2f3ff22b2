"""The ``lakeshard`` command: bad arguments get one clear line and exit status 2, never a traceback."""

from __future__ import annotations

import pytest

from tests.support.cli import run_cli


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["export", "smollm2-135m"], "one of the arguments --stages --split is required"),
        (["export", "smollm2-135m", "--stages", "0"], "expected a positive integer"),
        (["export", "smollm2-135m", "--stages", "two"], "expected a positive integer"),
        (["export", "smollm2-135m", "--stages", "31"], "cannot split 30 layers into 31 stages"),
        (["export", "smollm2-135m", "--split", "40"], "split points must be increasing"),
        (["export", "smollm2-135m", "--split", "a,b"], "expected layer numbers"),
        (["export", "smollm2-135m", "--stages", "2", "--split", "10"], "not allowed with argument"),
        (["export", "smollm2-135m", "--stages", "2", "--weights", "int3"], "invalid choice: 'int3'"),
        (["export", "smollm2-135m", "--stages", "2", "--group-size", "0"], "group size must be positive"),
        (["export", "no-such-model", "--stages", "2"], "unknown model 'no-such-model'"),
        (["export", "/nonexistent/model.gguf", "--stages", "2"], "unknown model '/nonexistent/model.gguf'"),
        (["generate", "smollm2-135m", "--prompt", "hi", "--temperature", "-1"], "temperature must be"),
        (["generate", "smollm2-135m", "--prompt", "hi", "--top-p", "2"], "top_p must be"),
        (["generate", "smollm2-135m", "--prompt", "hi", "--device", "NPU"], "device 'NPU' is not available"),
        (["generate", "smollm2-135m"], "the following arguments are required: --prompt"),
        (["models", "pull", "gpt-5"], "unknown model 'gpt-5'"),
        (["models", "pull", "smollm2-135m", "--find-links", "/nonexistent"], "not a directory"),
        (["models", "import", "/nonexistent/dir"], "does not exist"),
        (["bench", "parity", "--runs", "0"], "expected a positive integer"),
        (["bench", "spec", "--k", "auto,x"], "--k takes auto or numbers"),
        (["bench", "prefill", "--stages", "1,2"], "pieces only overlap on 2 stages or more"),
        (["bench", "prefill", "--stages", "2", "--cores-per-node", "64"], "2 nodes x 64 cores need 128 cores"),
        (["bench", "pipeline", "--spin-ms=50,-1"], "--spin-ms: no negative values"),
        (["bench", "pipeline", "--head-help=auto,maybe"], "--head-help: auto, on or off"),
        (["bench", "batching", "--users", "0,2"], "--users: one or more positive numbers"),
        (["bench", "batching", "--users", "two"], "--users: one or more positive numbers"),
        (["serve", "--nodes", "127.0.0.1:7700", "--spec-k", "3"], "--spec-k needs --draft"),
        (["serve", "--nodes", "127.0.0.1:7700", "--draft", "lookup", "--spec-k", "many"], "expected auto or a number"),
        (["serve", "--nodes", "127.0.0.1:7700", "--link-mbps", "-5"], "--link-mbps must not be negative"),
        (["agent", "--cluster", "bad id!"], "cluster_id: 'bad id!' must be"),
        (["agent", "--static-peers", "10.0.0.1"], "--static-peers: '10.0.0.1' is not host:port"),
        (["agent", "--config", "/nonexistent/lakeshard.yaml"], "no such settings file"),
        (["status", "--api-port", "1"], "no agent answers on 127.0.0.1:1"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_get_a_clear_error(smollm2, args: list[str], message: str) -> None:  # type: ignore[no-untyped-def]
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_help_lists_the_subcommands() -> None:
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("models", "export", "generate", "agent", "status", "bench"):
        assert cmd in r.stdout
