"""Where lakeshard keeps things: platformdirs locations, overridable with LAKESHARD_HOME."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import platformdirs

APP = "lakeshard"


def _home() -> Path | None:
    v = os.environ.get("LAKESHARD_HOME")
    return Path(v).expanduser() if v else None


def cache_dir() -> Path:
    """Models, exports and compiled-model blobs (large, re-creatable)."""
    h = _home()
    p = h / "cache" if h else Path(platformdirs.user_cache_dir(APP))
    p.mkdir(parents=True, exist_ok=True)
    return p


def config_dir() -> Path:
    h = _home()
    p = h / "config" if h else Path(platformdirs.user_config_dir(APP))
    p.mkdir(parents=True, exist_ok=True)
    return p


def state_dir() -> Path:
    """Small persistent state: the node id, the election term."""
    h = _home()
    p = h / "state" if h else Path(platformdirs.user_state_dir(APP))
    p.mkdir(parents=True, exist_ok=True)
    return p


DEFAULT_DATA_PORT = 7700


def agent_state_dir(port: int) -> Path:
    """The state folder of the agent listening on data ``port``: the default port (or 0, any
    port) keeps the plain folder; another port gets a folder of its own, so several agents on
    one machine each keep their own node id and election term."""
    base = state_dir()
    if port in (0, DEFAULT_DATA_PORT):
        return base
    p = base / f"port-{port}"
    p.mkdir(parents=True, exist_ok=True)
    return p


def log_dir() -> Path:
    h = _home()
    p = h / "logs" if h else Path(platformdirs.user_log_dir(APP))
    p.mkdir(parents=True, exist_ok=True)
    return p


def _shared_cache() -> Path:
    """Models and exports may live in a cache shared by several agents (LAKESHARD_SHARED_CACHE)."""
    v = os.environ.get("LAKESHARD_SHARED_CACHE")
    return Path(v).expanduser() if v else cache_dir()


def _configured_models_dir() -> Path | None:
    """``models_dir`` from config.yaml, if set (the agent checks the file itself; here a bad one is ignored)."""
    f = config_dir() / "config.yaml"
    try:
        import yaml

        v = (yaml.safe_load(f.read_text(encoding="utf-8")) or {}).get("models_dir") if f.is_file() else None
    except Exception:
        return None
    return Path(v).expanduser() if isinstance(v, str) and v.strip() else None


def models_dir() -> Path:
    """Where models are stored: LAKESHARD_MODELS_DIR, else config.yaml's models_dir, else the cache."""
    env = os.environ.get("LAKESHARD_MODELS_DIR")
    p = Path(env).expanduser() if env else (_configured_models_dir() or _shared_cache() / "models")
    p.mkdir(parents=True, exist_ok=True)
    return p


def exports_dir() -> Path:
    p = _shared_cache() / "exports"
    p.mkdir(parents=True, exist_ok=True)
    return p


def compiled_cache_dir() -> Path:
    p = cache_dir() / "ov-compiled"
    p.mkdir(parents=True, exist_ok=True)
    return p


def write_json_atomic(path: Path, data: Any, **dump: Any) -> None:
    """Write JSON so that readers see the old file or the new one, never half of it (even after a crash)."""
    write_text_atomic(path, json.dumps(data, **dump))


def write_text_atomic(path: Path, text: str) -> None:
    """Write a text file so that readers see the old file or the new one, never half of it."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` so that readers see the old file or the new one, never half of it (even
    after a crash). The file is 0600 (mkstemp's) unless ``mode`` says otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if mode is not None:
            with contextlib.suppress(OSError, NotImplementedError, AttributeError):
                os.fchmod(fd, mode)  # not on every platform: there the file stays 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
