"""The ``lakeshard`` command: one console script, with subcommands.

Each package adds its own subcommands (``add_commands``): this package's here, the
coordinator's and the tray's through the ``lakeshard.commands`` entry point (pyproject.toml),
since ``agent`` never imports the packages above it. Heavy modules (torch, OpenVINO,
transformers, Qt) are imported only by the subcommands that need them, so ``lakeshard --help``
and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from agent import version
from agent.cli import agent as agent_cmds
from agent.cli import cluster as cluster_cmds
from agent.cli import doctor as doctor_cmds
from agent.cli import models as models_cmds
from agent.cli.args import EXIT_USAGE, Commands

log = logging.getLogger(__name__)
COMMANDS_GROUP = "lakeshard.commands"


def build_parser() -> tuple[argparse.ArgumentParser, Commands]:
    ap = argparse.ArgumentParser(prog="lakeshard", description="Pool idle laptops into one LLM.")
    ap.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")
    ap.add_argument("--version", action="version", version=f"lakeshard {version()}")
    commands = Commands(ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND"))
    models_cmds.add_commands(commands)
    agent_cmds.add_commands(commands)
    cluster_cmds.add_commands(commands)
    doctor_cmds.add_commands(commands)
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            ep.load()(commands)
        except ImportError as e:  # an extra not installed (the GUI's): its commands are missing, the rest work
            log.debug("the %s commands are not available: %s", ep.name, e)
    return ap, commands


def main(argv: Sequence[str] | None = None) -> int:
    ap, commands = build_parser()
    args = ap.parse_args(argv)
    from agent.common.logs import log_name, setup_logging

    setup_logging(args.verbose, log_name(args.cmd, getattr(args, "port", None)))
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if isinstance(e, tuple(commands.user_errors)):
            print(f"lakeshard: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        raise
