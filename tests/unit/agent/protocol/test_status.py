"""The typed status answers (``/v1/node``, ``/v1/cluster``): what the agent sends reads back the same,
an older agent's answer (no ``reason_kind``) still reads, and a bad field is refused by name."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from agent.protocol import Beat, decode, encode
from agent.protocol.codec import ProtocolError
from agent.protocol.status import ClusterStatus, NodeStatus, PauseReason, PeerStatus, StageStatus

STAGE: dict[str, Any] = {
    "term_seen": 3,
    "assigned": True,
    "stage": 1,
    "stages": 2,
    "layers": [12, 24],
    "model": "qwen2.5-coder-1.5b",
    "model_layers": 28,
    "device": "CPU",
    "streams": 1,
    "frames": 40,
    "head_steps": 0,
    "errors": 0,
    "compute_s": 1.5,
    "step_ms_p50": 12.5,
    "rss_mb": 812.0,
    "fetching": None,
    "preparing": None,
    "export": "0" * 32,
    "term": 3,
    "reused": 0,
    "next_rtt_ms": None,
    "paused": None,
    "last_step_at": 1.7e9,
    "threads": 4,
    "attention": "stateful",
}
NODE: dict[str, Any] = {
    "node": "n1",
    "name": "laptop-a",
    "cluster": "c1",
    "version": "0.9.0",
    "model": {"model": "qwen2.5-coder-1.5b", "why": "the cluster's setting"},
    "state": "paused",
    "reason": "92 C",
    "reason_kind": "heat",
    "paused_until": None,
    "throttle": {"enabled": True, "policy": None, "manual": None, "changes": 2},
    "tok_s": 0.0,
    "temp_c": 92.0,
    "role": "follower",
    "term": 3,
    "coordinator": "c9",
    "port": 7710,
    "api_port": 7701,
    "mdns": True,
    "links": "TLS",
    "mem_total": 16 << 30,
    "mem_free": 9 << 30,
    "speed_score": 240.5,
    "devices": ["CPU", "GPU"],
    "devices_detail": [{"name": "CPU", "score": 240.5, "mem_free": 9 << 30, "own_memory": False}],
    "capacity": {"probed": True},
    "stage": STAGE,
    "exports": [],
    "log_dir": "/tmp/logs",
    "config_file": None,
    "started": 1.7e9,
    "peers": 2,
    "holds_ca": True,
    "hint": None,
    "error": None,
}
PEER: dict[str, Any] = {
    "node": "n2",
    "address": "10.0.0.2:7710",
    "alive": True,
    "last_heard_s": 0.4,
    "first_seen": 1.7e9,
    "first_heard": 1.7e9,
    "role": "coordinator",
    "term": 3,
    "state": "limited",
    "eligible": True,
    "score": 120.0,
    "mem_free": 4 << 30,
    "devices": ["CPU"],
    "offers": [{"name": "CPU", "score": 120.0, "mem_free": 4 << 30, "own_memory": False}],
    "version": "0.9.0",
    "name": "laptop-b",
    "reason": "other programs use 70% CPU",
    "reason_kind": "load",
    "rtt_ms": 1.2,
}
CLUSTER: dict[str, Any] = {
    "node": "n1",
    "cluster": "c1",
    "role": "follower",
    "term": 3,
    "coordinator": "n2",
    "coordinator_since": 1.7e9,
    "eligible": False,
    "state": "paused",
    "reason": "92 C",
    "reason_kind": "heat",
    "not_eligible_because": "paused",
    "peers": [PEER],
    "history": [{"term": 3, "at": 1.7e9}],
    "election_traffic": {"mode": "signed"},
    "links": "TLS",
    "services": None,
    "gateway": "n2 at 10.0.0.2:7701",
    "hint": None,
}
NO_CLUSTER_NODE = {"node": "n1", "state": "no_cluster", "role": "no_cluster", "hint": "run 'lakeshard cluster init'"}


@pytest.mark.parametrize(
    ("kind", "wire"),
    [
        (NodeStatus, NODE),
        (NodeStatus, NO_CLUSTER_NODE),
        (StageStatus, STAGE),
        (StageStatus, {"assigned": False}),
        (
            StageStatus,
            {**STAGE, "attention": "paged", "kv_blocks_total": 347, "kv_blocks_free": 300, "kv_block_tokens": 32},
        ),
        (StageStatus, {**STAGE, "attention": "stateful", "attention_fallback": "does not compile paged on NPU"}),
        (PeerStatus, PEER),
        (PeerStatus, {"node": "n3", "address": "10.0.0.3:7710", "alive": False}),  # heard of, no beat yet
        (ClusterStatus, CLUSTER),
        (ClusterStatus, {"node": "n1", "role": "standalone", "peers": [], "coordinator": None, "term": 0}),
    ],
)
def test_what_the_agent_sends_reads_back_the_same(kind: Any, wire: dict[str, Any]) -> None:
    typed = kind.parse(wire)
    again = typed.to_json()
    for key, value in wire.items():  # every key it had, with its value (none lost or changed)
        assert again[key] == value, key
    assert kind.parse(again) == typed
    assert kind.parse(again).to_json() == again


def test_the_typed_fields_read_as_types() -> None:
    n = NodeStatus.parse(NODE)
    assert n.reason_kind is PauseReason.HEAT and n.stage.layers == (12, 24) and n.devices == ("CPU", "GPU")
    assert n.details["throttle"]["changes"] == 2  # carried unread
    c = ClusterStatus.parse(CLUSTER)
    assert c.peers[0].reason_kind is PauseReason.LOAD and c.peers[0].offers[0].mem_free == 4 << 30


def test_a_stage_from_before_paged_attention_reads_as_unknown_attention() -> None:
    st = StageStatus.parse({k: v for k, v in STAGE.items() if k != "attention"})
    assert (st.attention, st.kv_blocks_total, st.kv_blocks_free) == (None, None, None)
    paged = StageStatus.parse({**STAGE, "attention": "paged", "kv_blocks_total": 10, "kv_blocks_free": 4})
    assert (paged.attention, paged.kv_blocks_total, paged.kv_blocks_free) == ("paged", 10, 4)


def test_an_older_agent_without_reason_kind_still_reads() -> None:
    old = {k: v for k, v in NODE.items() if k != "reason_kind"}
    assert NodeStatus.parse(old).reason_kind is None
    assert NodeStatus.parse(old).reason == "92 C"


def test_a_newer_agents_unknown_kind_reads_as_other() -> None:
    assert NodeStatus.parse({**NODE, "reason_kind": "solar-eclipse"}).reason_kind is PauseReason.OTHER


@pytest.mark.parametrize(
    ("cause", "kind"),
    [
        ("user", PauseReason.INPUT),
        ("hours", PauseReason.SCHEDULE),
        ("heat", PauseReason.HEAT),
        ("battery", PauseReason.BATTERY),
        ("lid", PauseReason.LID),
        ("load", PauseReason.LOAD),
        ("gpu", PauseReason.GPU),
        ("", None),
    ],
)
def test_every_throttle_cause_has_its_kind(cause: str, kind: PauseReason | None) -> None:
    assert PauseReason.from_cause(cause) is kind


def test_only_heat_and_battery_are_the_machines_doing() -> None:
    assert {k for k in PauseReason if k.heat_or_battery} == {PauseReason.HEAT, PauseReason.BATTERY}


@pytest.mark.parametrize(
    ("kind", "wire", "field"),
    [
        (NodeStatus, [], "node status"),
        (NodeStatus, {**NODE, "node": None}, "node"),
        (NodeStatus, {**NODE, "node": "no spaces allowed"}, "node"),
        (NodeStatus, {**NODE, "state": "asleep"}, "state"),
        (NodeStatus, {**NODE, "reason_kind": 7}, "reason_kind"),
        (NodeStatus, {**NODE, "reason_kind": ""}, "reason_kind"),
        (NodeStatus, {**NODE, "reason": "x" * 201}, "reason"),
        (NodeStatus, {**NODE, "role": "king"}, "role"),
        (NodeStatus, {**NODE, "term": -1}, "term"),
        (NodeStatus, {**NODE, "term": True}, "term"),
        (NodeStatus, {**NODE, "tok_s": "fast"}, "tok_s"),
        (NodeStatus, {**NODE, "temp_c": 1000}, "temp_c"),
        (NodeStatus, {**NODE, "port": 70000}, "port"),
        (NodeStatus, {**NODE, "mdns": "yes"}, "mdns"),
        (NodeStatus, {**NODE, "mem_free": 1.5}, "mem_free"),
        (NodeStatus, {**NODE, "devices": "CPU"}, "devices"),
        (NodeStatus, {**NODE, "peers": -2}, "peers"),
        (NodeStatus, {**NODE, "holds_ca": 1}, "holds_ca"),
        (NodeStatus, {**NODE, "paused_until": "later"}, "paused_until"),
        (NodeStatus, {**NODE, "stage": "serving"}, "stage"),
        (NodeStatus, {**NODE, "stage": {**STAGE, "layers": [24, 12]}}, "stage.layers"),
        (NodeStatus, {**NODE, "stage": {**STAGE, "stage": 2}}, "stage.stage"),
        (NodeStatus, {**NODE, "stage": {**STAGE, "assigned": None}}, "stage.assigned"),
        (NodeStatus, {**NODE, "stage": {**STAGE, "device": "a graphics card"}}, "stage.device"),
        (NodeStatus, {**NODE, "stage": {**STAGE, "step_ms_p50": -1}}, "stage.step_ms_p50"),
        (NodeStatus, {**NODE, "stage": {**STAGE, "attention": "fast"}}, "stage.attention"),
        (NodeStatus, {**NODE, "stage": {**STAGE, "kv_blocks_total": 8, "kv_blocks_free": 9}}, "stage.kv_blocks_free"),
        (ClusterStatus, {**CLUSTER, "role": None}, "role"),
        (ClusterStatus, {**CLUSTER, "peers": {}}, "peers"),
        (ClusterStatus, {**CLUSTER, "eligible": "no"}, "eligible"),
        (ClusterStatus, {**CLUSTER, "coordinator": 5}, "coordinator"),
        (ClusterStatus, {**CLUSTER, "peers": [{**PEER, "alive": None}]}, "peers[].alive"),
        (ClusterStatus, {**CLUSTER, "peers": [{**PEER, "state": "asleep"}]}, "peers[].state"),
        (ClusterStatus, {**CLUSTER, "peers": [{**PEER, "reason_kind": ["heat"]}]}, "peers[].reason_kind"),
        (ClusterStatus, {**CLUSTER, "peers": [{**PEER, "offers": [{"name": "CPU"}]}]}, "peers[].offers[]"),
        (PeerStatus, {**PEER, "rtt_ms": -3}, "peers[].rtt_ms"),
    ],
)
def test_a_bad_field_is_refused_by_name(kind: Any, wire: Any, field: str) -> None:
    with pytest.raises(ProtocolError) as e:
        kind.parse(wire)
    assert e.value.code == "bad_field"
    assert str(e.value).startswith(field), str(e.value)


def test_beats_carry_the_kind_and_an_older_peers_beat_still_parses() -> None:
    beat = Beat("c1", "n2", 7710, 3, "follower", "n1", "paused", False, 1.0, 1, 2, ("CPU",), "0.9", reason="95 C")
    sent = replace(beat, reason_kind=PauseReason.HEAT.value)
    assert decode(encode(sent))[0] == sent
    old = {k: v for k, v in sent.header().items() if k != "reason_kind"}  # an agent from before the field
    assert Beat.parse(old) == beat and Beat.parse(old).reason_kind is None
    with pytest.raises(ProtocolError, match="reason_kind"):
        Beat.parse({**sent.header(), "reason_kind": 3})
