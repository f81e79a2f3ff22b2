"""What every package's subcommands share: the registry they add themselves to, argument types,
and the error that is the user's to fix."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

EXIT_USAGE = 2


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def positive_int(v: str) -> int:
    try:
        i = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v!r}") from None
    if i < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v!r}")
    return i


def count(what: str) -> Any:
    """A non-negative integer of ``what`` (0: unlimited)."""

    def parse(v: str) -> int:
        try:
            i = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {what} (0: unlimited), got {v!r}") from None
        if i < 0:
            raise argparse.ArgumentTypeError(f"expected a number of {what} (0: unlimited), got {v!r}")
        return i

    return parse


def spec_k(v: str) -> int | None:
    if v == "auto":
        return None
    try:
        k = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number of tokens, got {v!r}") from None
    if not 0 <= k <= 64:
        raise argparse.ArgumentTypeError("K must be between 0 and 64")
    return k


def port(v: str) -> int:
    try:
        p = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {v!r}") from None
    if not 0 <= p <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {p}")
    return p


def nodes(v: str) -> list[str]:
    out = []
    for item in v.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"expected host:port, got {item!r}")
        out.append(f"{host}:{int(port)}")
    return out


def cuts(v: str) -> list[int]:
    try:
        cuts = [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer numbers like 16 or 10,20, got {v!r}") from None
    if not cuts:
        raise argparse.ArgumentTypeError("expected at least one split point")
    return cuts


def add_split_args(p: argparse.ArgumentParser, default_stages: int | None) -> None:
    g = p.add_mutually_exclusive_group(required=default_stages is None)
    g.add_argument("--stages", type=positive_int, default=default_stages, help="number of stages (cost-balanced split)")
    g.add_argument("--split", type=cuts, help="first layer of each stage after the first, e.g. 16 or 10,20")


def add_weights_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"], help="weight format (default: per model)")
    p.add_argument("--group-size", type=int, default=128, help="INT4 group size (default 128; -1 per channel)")


Run = Callable[[argparse.Namespace], int]


class Commands:
    """The ``lakeshard`` subcommands, as each package adds its own (``add_commands(commands)``):
    a parser with the function that runs it, and the exceptions that are the user's to fix
    (printed as one line, exit status 2, never a traceback)."""

    def __init__(self, sub: Any) -> None:
        self.sub = sub  # argparse's subparsers
        self.user_errors: list[type[BaseException]] = [CliError]

    def add(self, name: str, help: str, run: Run) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = self.sub.add_parser(name, help=help)
        p.set_defaults(run=run)
        return p
