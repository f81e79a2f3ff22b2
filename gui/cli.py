"""``lakeshard tray``, added to the command line through the ``lakeshard.commands`` entry point
(pyproject.toml). Qt is imported only when the tray runs."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_commands(commands: Any) -> None:
    """``commands``: the command line's registry (``agent.cli.args.Commands``; the GUI talks to the
    agent only over HTTP, so it is not imported here)."""
    t = commands.add("tray", "the system-tray app: this laptop's state, the chat window and the node map", _run)
    t.add_argument("--api-port", type=int, default=None, help="the local agent's status API port (default: settings)")
    t.add_argument("--no-agent", action="store_true", help="attach to a running agent only; never start one")
    t.add_argument("--agent-arg", action="append", default=[], help="an extra argument for the agent it starts")


def _run(args: argparse.Namespace) -> int:
    try:
        from gui.app import run_tray
    except ImportError as e:
        print(f"lakeshard: error: the tray needs the GUI extra (pip install 'lakeshard[gui]'): {e}", file=sys.stderr)
        return 2
    return run_tray(args)
