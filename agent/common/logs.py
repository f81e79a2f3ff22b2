"""Logging to the platformdirs log folder, plus concise messages on stderr."""

from __future__ import annotations

import logging
import logging.handlers

from agent.common.paths import log_dir


def log_name(cmd: str | None, port: int | None = None) -> str:
    """The log file of one process, by its role: ``agent`` (``agent-PORT`` on another data port:
    several agents on one machine each write their own), ``serve``, ``bench``; other commands
    share ``lakeshard``. One writer per file, so rotation never races another process."""
    if cmd == "agent":
        return "agent" if port in (None, 0, 7700) else f"agent-{port}"
    if cmd in ("serve", "bench", "demo", "tray"):
        return cmd
    return "lakeshard"


def setup_logging(verbose: bool = False, name: str = "lakeshard") -> None:
    root = logging.getLogger()
    if any(getattr(h, "_lakeshard", False) for h in root.handlers):
        return
    root.setLevel(logging.DEBUG)
    fh = logging.handlers.RotatingFileHandler(log_dir() / f"{name}.log", maxBytes=5_000_000, backupCount=3)
    fh.setLevel(logging.DEBUG)
    fh.setFormatter(logging.Formatter(f"%(asctime)s {name}[%(process)d] %(name)s %(levelname)s %(message)s"))
    fh._lakeshard = True  # type: ignore[attr-defined]
    sh = logging.StreamHandler()
    sh.setLevel(logging.DEBUG if verbose else logging.WARNING)
    sh.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    sh._lakeshard = True  # type: ignore[attr-defined]
    root.addHandler(fh)
    root.addHandler(sh)
    for noisy in ("urllib3", "filelock", "nncf", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def set_file_level(level: str) -> None:
    """What the log file keeps from now on (``log_level`` in the settings)."""
    for h in logging.getLogger().handlers:
        if getattr(h, "_lakeshard", False) and isinstance(h, logging.FileHandler):
            h.setLevel(getattr(logging, level.upper(), logging.DEBUG))
