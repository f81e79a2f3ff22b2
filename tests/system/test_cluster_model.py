"""One model setting for the whole cluster (issue 37), on a real secured 3-agent cluster.

No agent has serve.model (each serves one stream, so a plan is one laptop: one export a model).
The elected coordinator first says it serves no model, naming its laptop. The cluster's model
is set on a laptop that does not coordinate, through its local API: every member holds the same
signed setting within seconds and the coordinator serves it (a chat answer through another
laptop's agent). The setting changes to another model: the coordinator
re-plans onto it. The coordinator dies: the one elected instead serves the same model. And an
unknown name is refused, by the local API (400) and by the CLI (one line).
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from coordinator.lab.local_cluster import LocalCluster
from tests.support.cli import run_cli
from tests.support.figures import report
from tests.support.served import post_chat
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(900)
NAMES = ["alice-laptop", "bob-laptop", "carol-laptop"]
CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}


def _get(port: int, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _put(port: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/cluster/model",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
        method="PUT",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _found(got: Any) -> bool:
    return got is not None and got is not False  # (an agent's index may be 0)


def _listed(port: int) -> list[str]:
    return [m["id"] for m in (_get(port, "/v1/models") or {}).get("data", [])]


def test_the_cluster_serves_the_model_set_on_any_member(smollm2: Any, tmp_path: Path) -> None:
    # the agents' store: the test model, and the same weights under a second name (a second model
    # for the API, made the way a user adds one; the user's own store is left as it was)
    store = tmp_path / "models"
    store.mkdir()
    (store / "smollm2-135m").symlink_to(smollm2.dir, target_is_directory=True)
    env = {"LAKESHARD_MODELS_DIR": str(store)}
    r = run_cli("models", "import", str(smollm2.checkpoint), "--name", "smollm2-alt", env=env)
    assert r.returncode == 0, r.stderr
    # one stream: the model stays on one laptop (one export of each model, and no spare split)
    config = "serve:\n  streams: 1\n"
    with LocalCluster(3, elect=[], secure=True, form=True, names=NAMES, env=env, log_dir=tmp_path, config=config) as c:
        ports = c.api_ports
        nodes = [_get(p, "/v1/node")["node"] for p in ports]
        alive = [0, 1, 2]

        def coordinator() -> int | None:
            """The agent every live agent names as coordinator (None while they disagree or elect)."""
            seen = {(_get(ports[i], "/v1/cluster") or {}).get("coordinator") for i in alive}
            node = seen.pop() if len(seen) == 1 else None
            return nodes.index(node) if node in nodes else None

        def services(i: int) -> dict[str, Any]:
            return dict((_get(ports[i], "/v1/cluster") or {}).get("services") or {})

        def serving(model: str) -> int | None:
            """The coordinator, once it serves ``model`` (whichever agent the election chose)."""
            i = coordinator()
            sv = services(i) if i is not None else {}
            return i if sv.get("model") == model and sv.get("state") == "serving" else None

        def holds(version: int) -> bool:
            return all(
                ((_get(ports[i], "/v1/cluster/model") or {}).get("cluster") or {}).get("version") == version
                for i in alive
            )

        def logs() -> dict[int, Any]:
            """What each agent says: its services, and the tail of its log file."""
            out: dict[int, Any] = {}
            for i in range(3):
                text = "".join(f.read_text(errors="replace") for f in sorted((c.home(i) / "logs").glob("*.log")))
                out[i] = (services(i), text[-2500:])
            return out

        def coordinating() -> int | None:
            i = coordinator()
            return i if i is not None and services(i) else None

        ci = wait_until(coordinating, 60, what="one coordinator, its services up", ok=_found, step=0.25, diagnose=logs)

        # nothing chosen: the chat says so, naming the coordinator's laptop
        status, body = post_chat(f"http://127.0.0.1:{ports[(ci + 1) % 3]}", CHAT, timeout=30)
        assert status == 503, body
        msg = body["error"]["message"]
        assert re.match(r"the coordinator (alice|bob|carol)-laptop serves no model: choose the cluster's model", msg)
        assert all(_get(p, "/v1/cluster/model")["cluster"] is None for p in ports)

        # an unknown name: refused by the agent (400) and by the CLI (one line)
        setter, other = [i for i in range(3) if i != ci]
        status, body = _put(ports[setter], {"model": "no-such-model"})
        assert status == 400 and body["error"]["code"] == "unknown_model", body
        assert "choose one of smollm2-135m" in body["error"]["message"] and "smollm2-alt" in body["error"]["message"]
        cli = run_cli("cluster", "model", "no-such-model", "--api-port", str(ports[setter]))
        assert cli.returncode != 0 and cli.stdout == ""
        assert cli.stderr.strip().count("\n") == 0 and "unknown model 'no-such-model'" in cli.stderr, cli.stderr

        # set on a laptop that does not coordinate: every member holds it within seconds
        t0 = time.monotonic()
        status, body = _put(ports[setter], {"model": "smollm2-135m", "weights": "int8"})
        assert status == 200, body
        v1 = body["cluster"]["version"]
        assert body["cluster"]["set_by"] == nodes[setter] and body["cluster"]["label"].endswith(NAMES[setter])
        wait_until(lambda: holds(v1), 10, what=f"every member holds v{v1}", ok=_found, step=0.25)
        spread = time.monotonic() - t0
        for p in ports:
            eff = _get(p, "/v1/cluster/model")["effective"]
            assert (eff["model"], eff["source"]) == ("smollm2-135m", "cluster"), eff
        st = _get(ports[ci], "/v1/cluster")["cluster_settings"]
        assert st["adopted"] == 1 and st["refused"] == 0 and st["signed"], st
        shown = run_cli("status", "--api-port", str(ports[other]))
        assert f"serves when elected: smollm2-135m: cluster setting v{v1} by {NAMES[setter]}" in shown.stdout

        # the elected coordinator serves it: a chat answer through another laptop's agent
        ci = wait_until(
            lambda: serving("smollm2-135m"),
            300,
            what="the coordinator serves smollm2-135m",
            ok=_found,
            step=0.25,
            diagnose=logs,
        )
        serve1 = time.monotonic() - t0
        status, body = post_chat(f"http://127.0.0.1:{ports[(ci + 1) % 3]}", CHAT)
        assert status == 200 and body["choices"][0]["message"]["content"], body
        assert _listed(ports[(ci + 2) % 3]) == ["smollm2-135m"]

        # changed (from the CLI, on another laptop): the coordinator re-plans onto the new model
        t1 = time.monotonic()
        cli = run_cli("cluster", "model", "smollm2-alt", "--weights", "int8", "--api-port", str(ports[other]))
        assert cli.returncode == 0, cli.stderr
        assert f"by {NAMES[other]}: the cluster serves smollm2-alt (int8)" in cli.stdout, cli.stdout
        wait_until(lambda: holds(v1 + 1), 10, what="every member holds the new setting", ok=_found, step=0.25)
        ci = wait_until(
            lambda: serving("smollm2-alt"),
            300,
            what="the coordinator serves smollm2-alt",
            ok=_found,
            step=0.25,
            diagnose=logs,
        )
        replan = time.monotonic() - t1
        assert _listed(ports[(ci + 1) % 3]) == ["smollm2-alt"]
        status, body = post_chat(f"http://127.0.0.1:{ports[(ci + 2) % 3]}", CHAT)
        assert status == 200 and body["model"] == "smollm2-alt", body
        shown = run_cli("cluster", "model", "--api-port", str(ports[ci]))
        assert f"cluster model: smollm2-alt (weights int8), cluster setting v{v1 + 1} by {NAMES[other]}" in shown.stdout

        # the coordinator dies: the one elected instead serves the cluster's model
        c.kill(ci)
        alive.remove(ci)
        t2 = time.monotonic()
        ni = wait_until(
            lambda: serving("smollm2-alt"),
            300,
            what="another coordinator serves smollm2-alt",
            ok=_found,
            step=0.25,
            diagnose=logs,
        )
        failover = time.monotonic() - t2
        assert ni != ci
        status, body = post_chat(f"http://127.0.0.1:{ports[alive[0]]}", CHAT)
        assert status == 200 and body["model"] == "smollm2-alt", body
        assert _listed(ports[alive[1]]) == ["smollm2-alt"]
    report(
        f"cluster model: every member held the setting {spread:.1f} s after it was set; served after {serve1:.0f} s; "
        f"re-planned onto a new model in {replan:.0f} s; served again {failover:.0f} s after the coordinator died"
    )


def test_a_plaintext_cluster_shares_the_setting_unsigned_and_web_pages_cannot_set_it(smollm2: Any) -> None:
    """--insecure agents (no credentials): the setting travels unsigned. Neither agent can
    coordinate here (no laptop has 4 TB), so nothing is exported: this is about the setting."""
    config = "election:\n  min_coordinator_memory_gb: 4096\n"
    env = {"LAKESHARD_MODELS_DIR": str(smollm2.dir.parent)}
    with LocalCluster(2, elect=[], names=NAMES[:2], env=env, config=config) as c:
        a, b = c.api_ports
        # a web page cannot reach it: a browser sends an Origin (or, rebinding DNS, a foreign Host)
        for headers in ({"Origin": "http://evil.example"}, {"Host": "evil.example"}):
            req = urllib.request.Request(
                f"http://127.0.0.1:{a}/v1/cluster/model",
                b'{"model": "smollm2-135m"}',
                {"Content-Type": "application/json", **headers},
                method="PUT",
            )
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 403
        status, body = _put(a, {"model": "smollm2-135m", "draft": "lookup"})
        assert status == 200, body
        held = wait_until(
            lambda: (_get(b, "/v1/cluster/model") or {}).get("cluster"),
            20,
            what="the other agent holds it",
            ok=_found,
            step=0.25,
        )
        assert (held["version"], held["model"], held["draft"], held["set_by_name"]) == (
            1,
            "smollm2-135m",
            "lookup",
            NAMES[0],
        )
        st = _get(b, "/v1/cluster")["cluster_settings"]
        assert st["adopted"] == 1 and not st["signed"], st
