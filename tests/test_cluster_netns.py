"""Real agents, each in its own network namespace on a bridged LAN: mDNS, election, fencing.

Root only (CI runs as root). Every test builds its LAN in a fixture that tears it down
(namespaces, bridges, processes) whether the test passes or fails.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.bench import netns
from agent.bench.lab import API_PORT, AgentLab, agreed
from agent.protocol import Ack, Beat, decode, encode

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=netns.available() or "")
BOOT_S = 90.0  # four agents importing OpenVINO at once on two cores take a while
ELECT_S = 20.0  # generous; `lakeshard bench election` measures the real figure


@pytest.fixture
def lab_factory(tmp_path: Path) -> Iterator[Any]:
    labs: list[AgentLab] = []

    def make(n: int, split: int | None = None) -> AgentLab:
        lab = AgentLab(n, tmp_path, cluster="ci", split=split).__enter__()
        labs.append(lab)
        return lab

    yield make
    for lab in labs:
        lab.close()
    leftovers = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{netns.PREFIX}{__import__('os').getpid()}n" not in leftovers


def _history_is_fenced(view: dict[int, dict[str, Any] | None]) -> None:
    """No agent ever admitted two coordinators in one term."""
    for v in view.values():
        assert v is not None
        per_term: dict[int, str] = {}
        for h in v["history"]:
            assert per_term.setdefault(h["term"], h["coordinator"]) == h["coordinator"], v["history"]


def _stale_beat(term: int) -> bytes:
    b = Beat("ci", "usurper", 7700, term, "coordinator", "usurper", "available", True, 1.0, 1, 2, ("CPU",), "0.1.0")
    return encode(b)


def test_four_agents_discover_each_other_and_agree(lab_factory: Any) -> None:
    lab: AgentLab = lab_factory(4)
    lab.start_all()
    view = lab.wait_for(lambda v: agreed(v, peers_alive=3) is not None, range(4), BOOT_S)
    coord = agreed(view)
    assert sum(v["role"] == "coordinator" for v in view.values() if v) == 1
    terms = {v["term"] for v in view.values() if v}
    assert len(terms) == 1 and terms.pop() >= 1
    # each peer as advertised: capacity figures came over the LAN
    for v in view.values():
        assert v is not None
        for p in v["peers"]:
            assert p["devices"] == ["CPU"] and p["mem_free"] > 0 and p["state"] == "available"
    # `lakeshard status` (the user's command) inside a namespace shows the same picture
    out = subprocess.run(
        lab.lan.nodes[1].cmd([sys.executable, "-m", "agent", "status", "--api-port", str(API_PORT)]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"coordinator {coord}" in out.stdout
    assert sum(p["node"] in out.stdout for p in view[1]["peers"]) == 3  # type: ignore[index]

    # pausing the coordinator (the tray's switch) hands coordination to another node
    ci = next(i for i, v in view.items() if v and v["node"] == coord)
    node = lab.post(ci, "/v1/node/state", {"state": "paused"})
    assert node is not None and node["state"] == "paused"
    view = lab.wait_for(lambda v: agreed(v) not in (None, coord), range(4), ELECT_S)
    assert view[ci]["not_eligible_because"] == "paused"  # type: ignore[index]
    _history_is_fenced(view)


def test_killing_the_coordinator_elects_another_with_a_higher_term(lab_factory: Any) -> None:
    lab: AgentLab = lab_factory(4)
    lab.start_all()
    view = lab.wait_for(lambda v: agreed(v, peers_alive=3) is not None, range(4), BOOT_S)
    old = agreed(view)
    term = max(v["term"] for v in view.values() if v)
    dead = next(i for i, v in view.items() if v and v["node"] == old)
    lab.kill(dead)
    rest = [i for i in range(4) if i != dead]
    view = lab.wait_for(lambda v: agreed(v, peers_alive=2) not in (None, old), rest, ELECT_S)
    assert all(v["term"] > term for v in view.values() if v)
    _history_is_fenced(view)
    # it comes back (same node id, persisted term): it follows, and nothing is disrupted
    new = agreed(view)
    lab.start(dead)
    view = lab.wait_for(lambda v: agreed(v, peers_alive=3) is not None, range(4), BOOT_S)
    assert agreed(view) == new
    assert view[dead]["term"] == max(v["term"] for v in view.values() if v)  # type: ignore[index]


def test_partition_keeps_terms_fenced_and_heals_to_one_coordinator(lab_factory: Any) -> None:
    lab: AgentLab = lab_factory(4, split=2)  # nodes 0,1 on bridge A; 2,3 on bridge B
    lab.start_all()
    view = lab.wait_for(lambda v: agreed(v, peers_alive=3) is not None, range(4), BOOT_S)
    before = max(v["term"] for v in view.values() if v)
    lab.lan.partition()
    a = lab.wait_for(lambda v: agreed(v, peers_alive=1) is not None, [0, 1], ELECT_S)
    b = lab.wait_for(lambda v: agreed(v, peers_alive=1) is not None, [2, 3], ELECT_S)
    assert agreed(a) != agreed(b)  # each half carries on with its own coordinator...
    term_b = max(v["term"] for v in b.values() if v)
    assert max(max(v["term"] for v in a.values() if v), term_b) > before  # ...one of them newly elected
    # a command from an older term is refused with an error, not obeyed
    reply = lab.udp(3, _stale_beat(before - 1 if before > 1 else 0), lab.lan.nodes[2].ip)
    assert reply is not None
    ack, _ = decode(reply)
    assert isinstance(ack, Ack) and not ack.accepted and ack.code == "stale_term"
    lab.lan.heal()
    view = lab.wait_for(lambda v: agreed(v, peers_alive=3) is not None, range(4), ELECT_S * 2)
    top = max(v["term"] for v in view.values() if v)
    coord = agreed(view)
    assert top >= term_b
    assert [v["role"] for v in view.values() if v].count("coordinator") == 1
    assert all(v["term"] == top for v in view.values() if v)
    assert any(v["node"] == coord and v["role"] == "coordinator" for v in view.values() if v)
    _history_is_fenced(view)


FORGER = r"""
import asyncio, socket, sys
from zeroconf.asyncio import AsyncZeroconf, AsyncServiceInfo
T = "_lakeshard._tcp.local."
ip = socket.inet_aton(sys.argv[1])
good = {"id": "forged", "cl": "ci", "v": "0.1.0", "dev": "CPU", "mem": "1000", "score": "5", "st": "available",
        "port": "7700"}
bad = [
    {**good, "id": "mem-words", "mem": "lots"},
    {**good, "id": "huge-score", "score": "1e308"},
    {**good, "id": "nan-score", "score": "nan"},
    {**good, "id": "port-zero", "port": "0"},
    {**good, "id": "sleepy", "st": "sleepy"},
    {**good, "id": "bad id with spaces"},
    {**good, "id": "lowercase-dev", "dev": "gpu;rm -rf"},
    {**good, "id": "other-cluster", "cl": "someone-else"},
    {k: v for k, v in good.items() if k != "cl"} | {"id": "no-cluster"},
]
async def main():
    azc = AsyncZeroconf(interfaces=[sys.argv[1]])
    infos = [AsyncServiceInfo(T, f"forged{i}.{T}", addresses=[ip], port=7700, properties=p) for i, p in enumerate(bad)]
    for info in infos:
        await azc.async_register_service(info, cooperating_responders=True)
    print("registered", flush=True)
    await asyncio.sleep(float(sys.argv[2]))
    await azc.async_close()
asyncio.run(main())
"""


def test_forged_and_malformed_advertisements_are_ignored(lab_factory: Any) -> None:
    lab: AgentLab = lab_factory(3)
    lab.start(0)
    lab.start(1)
    lab.wait_for(lambda v: agreed(v, peers_alive=1) is not None, [0, 1], BOOT_S)
    forger = subprocess.Popen(
        lab.lan.nodes[2].cmd([sys.executable, "-c", FORGER, lab.lan.nodes[2].ip, "6"]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert forger.stdout is not None and forger.stdout.readline().strip() == "registered"
        # forged datagrams too: garbage, absurd numbers, another cluster
        target = lab.lan.nodes[0].ip
        absurd = Beat("ci", "absurd", 7700, 1, "follower", None, "available", True, 1.0, 1, 2, ("CPU",), "0.1.0")
        frame = encode(absurd).replace(b"\xa5score\xcb", b"\xa5score\xcb", 1)
        for junk in (b"", b"LS\x01\xff\xff\xff\xff", b"\x00" * 900, frame.replace(b"\xa2ci", b"\xa2zz")):
            assert lab.udp(2, junk, target, wait=0.2) is None
        forger.wait(timeout=30)
    finally:
        forger.kill()
    for i in (0, 1):
        assert lab.alive(i)
        v = lab.get(i, "/v1/cluster")
        assert v is not None
        assert [p["node"] for p in v["peers"]] == [lab.get(1 - i, "/v1/node")["node"]]  # type: ignore[index]
        assert v["datagrams_ignored"] >= (4 if i == 0 else 0)
    log = "".join(f.read_text() for f in (lab.homes[0] / "logs").glob("agent*.log"))  # the agent's own log
    assert "ignored a malformed advertisement" in log and "is not ours" in log
