"""Agents in network namespaces form a pipeline by themselves: elect, plan, deliver, serve.

Root only. Three agents share a model cache (the coordinator exports once) but not their
artifact caches: each agent downloads its own stage's files from the coordinator over HTTP.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.common.paths import cache_dir
from coordinator.lab import netns
from coordinator.lab.agents import DATA_PORT, AgentLab, agreed
from tests.support.figures import report
from tests.support.prompts import PROMPTS
from tests.support.reference import reference_answer
from tests.support.wait import wait_until

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=netns.available() or "")
SERVE_ARGS = ["--serve-model", "smollm2-135m", "--serve-weights", "int8", "--serve-exact"]


@pytest.fixture
def lab(tmp_path: Path, smollm2) -> Iterator[AgentLab]:  # type: ignore[no-untyped-def]
    with AgentLab(
        3, tmp_path, cluster="form", split=3, agent_args=SERVE_ARGS, env={"LAKESHARD_SHARED_CACHE": str(cache_dir())}
    ) as lab:
        yield lab


def _serving(lab: AgentLab, nodes: list[int], timeout: float) -> tuple[int, dict[str, Any]]:
    """Wait until a coordinator among ``nodes`` serves; returns its index and services status."""

    def formed() -> tuple[int, dict[str, Any]] | None:
        view = lab.clusters(nodes)
        coord = agreed(view, peers_alive=len(nodes) - 1)
        for i, v in view.items():
            if coord and v and v["node"] == coord and v.get("services"):
                sv = v["services"]
                assert sv["state"] != "failed", sv["error"]
                if sv["state"] == "serving":
                    return i, sv
        return None

    got = wait_until(formed, timeout, what="a pipeline formed", step=0.5, diagnose=lambda: lab.clusters(nodes))
    assert got is not None
    return got


def _generating(lab: AgentLab, besides: int) -> bool:
    """Whether a stage holds a stream: every node's data port asked from one namespace (not node
    ``besides``, whose probe is busy carrying a request)."""
    asker = next(k for k in range(lab.n) if k != besides)
    for node in lab.lan.nodes:
        r = lab.ask(asker, {"op": "get", "url": f"http://{node.ip}:{DATA_PORT}/v1/node", "timeout": 2})
        if r.get("ok") and ((r["body"] or {}).get("stage") or {}).get("streams"):
            return True
    return False


def _chat(lab: AgentLab, i: int, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    return lab.ask(i, {"op": "post", "url": "http://127.0.0.1:8000/v1/chat/completions", "body": body, "timeout": 300})


def test_agents_form_a_pipeline_and_a_new_coordinator_takes_over(lab, whole_int8, smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    lab.start_all()
    ci, sv = _serving(lab, [0, 1, 2], 600)
    assert sv["ring_port"] == DATA_PORT + 2  # one fixed port a firewall can open (serve.ring_port)
    plan = sv["plan"]
    assert plan[0]["layers"][0] == 0 and plan[-1]["layers"][1] == 30
    assert all(a["layers"][1] == b["layers"][0] for a, b in itertools.pairwise(plan))
    r = _chat(lab, ci, PROMPTS[0], 48)
    assert r["ok"], r
    assert r["body"]["choices"][0]["message"]["content"] == reference_answer(
        whole_int8, smollm2_tokenizer, PROMPTS[0], 48
    )
    # every planned agent serves its own layers, from files on its own disk: fetched from the
    # coordinator (its stage only), or the copy of the whole export it holds (the shared cache here)
    for st in plan:
        i = next(k for k in range(3) if (lab.get(k, "/v1/node") or {}).get("node") == st["node"])
        stage = lab.get(i, "/v1/node")["stage"]  # type: ignore[index]
        assert stage["assigned"] and stage["layers"] == st["layers"]
        # the planner chose one of the devices the agent offered, and the stage runs there
        offered = [d["name"] for d in lab.get(i, "/v1/node")["devices_detail"]]  # type: ignore[index]
        assert st["device"] in offered and stage["device"] == st["device"]
        arts = lab.homes[i] / "cache" / "artifacts"
        fetched = list(arts.iterdir()) if arts.is_dir() else []
        held = (lab.get(i, "/v1/node") or {}).get("exports", {}).get("held") or []
        assert (len(fetched) == 1 and (fetched[0] / "model.bin").is_file()) or stage["export"] in held

    # pausing a stage's laptop (its user came back) moves the plan off it; answers stay the same
    coord_node = lab.get(ci, "/v1/node")["node"]  # type: ignore[index]
    others = [st["node"] for st in plan if st["node"] != coord_node]
    if others:
        pi = next(k for k in range(3) if (lab.get(k, "/v1/node") or {}).get("node") == others[0])
        assert lab.post(pi, "/v1/node/state", {"state": "paused"}) is not None
        sv = wait_until(
            lambda: lab.get(ci, "/v1/cluster")["services"],  # type: ignore[index]
            300,
            what="a plan without the paused node",
            ok=lambda sv: (
                sv["replans"] and sv["state"] == "serving" and others[0] not in [st["node"] for st in sv["plan"]]
            ),
            step=0.5,
        )
        r = _chat(lab, ci, PROMPTS[0], 48)
        assert r["ok"], r
        want = reference_answer(whole_int8, smollm2_tokenizer, PROMPTS[0], 48)
        assert r["body"]["choices"][0]["message"]["content"] == want
        report(f"self-forming: {len(plan)} stage(s); a paused stage node moved the plan to {len(sv['plan'])} stage(s)")

    # kill the coordinator while it generates: that request ends (its API died with it) ...
    outcome: list[dict[str, Any]] = []
    t = threading.Thread(target=lambda: outcome.append(_chat(lab, ci, PROMPTS[1], 400)))
    t.start()
    wait_until(lambda: _generating(lab, besides=ci), 60, what="the answer to be under way on a stage", step=0.2)
    lab.kill(ci)
    t.join(60)
    assert outcome and not outcome[0]["ok"]
    # ... and the survivors elect a new coordinator, which plans over them and serves new requests
    rest = [k for k in range(3) if k != ci]
    cj, sv2 = _serving(lab, rest, 300)
    assert sv2["term"] > sv["term"] and len(sv2["plan"]) <= 2
    r = _chat(lab, cj, PROMPTS[0], 48)
    assert r["ok"], r
    assert r["body"]["choices"][0]["message"]["content"] == reference_answer(
        whole_int8, smollm2_tokenizer, PROMPTS[0], 48
    )
