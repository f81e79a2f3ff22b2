"""``lakeshard status`` in words: what a coordinator with no model yet prints."""

from __future__ import annotations

from agent.cli.agent import format_status
from agent.protocol.status import ClusterStatus, NodeStatus

NODE = {
    "node": "8e2b7ca7f8b1",
    "cluster": "gz56xqi5b2d6hh2j6oftsg6mha",
    "role": "coordinator",
    "state": "available",
    "port": 7710,
    "speed_score": 24.0,
    "mem_free": 21 * 10**9,
    "devices": ["CPU"],
}


def test_a_coordinator_without_a_model_says_no_model_not_none() -> None:
    """Right after 'Create a new cluster' no model is chosen: the line must not end in Python's None."""
    services: dict[str, object] = {
        "state": "no model",
        "model": None,
        "api": None,
        "plan": [],
        "error": None,
        "recoveries": [],
    }
    cluster = {"node": NODE["node"], "role": "coordinator", "term": 1, "coordinator": "8e2b7ca7f8b1", "eligible": True}
    text = format_status(NodeStatus.parse(NODE), ClusterStatus.parse({**cluster, "services": services}))
    assert "coordinator services: no model" in text.splitlines()
    assert "None" not in text
