"""Export one stage in a fresh process: ``python -m agent.export.worker < job.json``.

Prints the stage manifest as JSON on its last stdout line; progress goes to stderr.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings


def main() -> int:
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    from agent.export.exporter import export_stage

    job = json.loads(sys.stdin.read())
    manifest = export_stage(job)
    sys.stdout.write(json.dumps(manifest) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
