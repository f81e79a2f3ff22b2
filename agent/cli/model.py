"""``lakeshard cluster model [NAME] [--weights W] [--draft D]``: the model the cluster serves.

It asks the local agent (``GET`` / ``PUT /v1/cluster/model`` on 127.0.0.1, see
:mod:`agent.api.cluster_model`): the agent checks the name against its registry and store, signs
the setting in a secured cluster and announces it to every member. Every failure is one line
(:class:`agent.security.SecurityError`, which the CLI prints).
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

TIMEOUT_S = 30.0


def _call(port: int, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    from agent.security import SecurityError

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/cluster/model", data, {"Content-Type": "application/json"}, method=method
    )
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            err = json.loads(raw).get("error")
            msg = err.get("message") if isinstance(err, dict) else err
        except (ValueError, AttributeError):
            msg = None
        raise SecurityError(str(msg or f"the agent answered HTTP {e.code}")) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise SecurityError(f"no agent answers on 127.0.0.1:{port} ({e}); start one with 'lakeshard agent'") from None


def run_model(args: argparse.Namespace, settings: Callable[[], Any]) -> int:
    port = args.api_port if args.api_port is not None else settings().api_port
    if args.name is None:
        if args.weights or args.draft:
            from agent.security import SecurityError

            raise SecurityError("--weights and --draft go with a model name: lakeshard cluster model NAME --weights W")
        st = _call(port, "GET")
    else:
        st = _call(port, "PUT", {"model": args.name, "weights": args.weights, "draft": args.draft})
    print(json.dumps(st, indent=2) if args.json else format_model(st))
    return 0


def _what(model: str | None, weights: str | None, draft: str | None) -> str:
    extra = [w for w in (weights and f"weights {weights}", draft and f"draft {draft}") if w]
    return f"{model}" + (f" ({', '.join(extra)})" if extra else "")


def format_model(st: dict[str, Any]) -> str:
    """The answer of ``/v1/cluster/model`` as ``cluster model`` prints it (pure)."""
    lines = []
    if st.get("message"):
        lines.append(str(st["message"]))
    c = st.get("cluster")
    if c:
        lines.append(f"cluster model: {_what(c['model'], c['weights'], c['draft'])}, {c['label']}")
    else:
        lines.append("cluster model: none chosen yet (lakeshard cluster model NAME)")
    e = st.get("effective") or {}
    if e.get("model"):
        lines.append(
            f"this laptop serves, when elected: {_what(e['model'], e.get('weights'), e.get('draft'))}: {e['why']}"
        )
    else:
        lines.append(f"this laptop serves, when elected: nothing ({e.get('why', 'no model chosen')})")
    models = st.get("models") or []
    if models:
        names = [m["name"] + ("" if m.get("pulled") else " (downloads when served)") for m in models]
        lines.append("models: " + ", ".join(names))
    return "\n".join(lines)
