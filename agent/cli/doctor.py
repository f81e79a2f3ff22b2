"""``lakeshard doctor``: what this laptop offers, checked and printed (a table, or JSON)."""

from __future__ import annotations

import argparse

from agent.cli.args import Commands, port
from agent.doctor.probe import gather
from agent.doctor.report import overall, render_table, to_json


def add_commands(commands: Commands) -> None:
    dr = commands.add(
        "doctor", "check what this laptop offers (devices, memory, ports, mDNS, tray, sensors)", run_doctor
    )
    dr.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    dr.add_argument("--port", type=port, help="the data port to check (default: settings, else 7700)")
    dr.add_argument("--api-port", type=port, help="the status API port to check (default: settings, else 7701)")
    dr.add_argument("--config", help="settings file (default: config.yaml in the config folder)")


def run_doctor(args: argparse.Namespace) -> int:
    checks, version = gather(args.config, args.port, args.api_port)
    print(to_json(checks, version) if args.json else render_table(checks, version))
    return 1 if overall(checks) == "fail" else 0
