"""Real agents, each in its own network namespace on a bridged LAN: mDNS, election, fencing.

Root only (CI runs as root). Every test builds its LAN in a fixture that tears it down
(namespaces, bridges, processes) whether the test passes or fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.common.paths import cache_dir
from agent.protocol import Ack, Beat, decode, encode
from coordinator.lab import netns
from coordinator.lab.agents import API_PORT, DATA_PORT, AgentLab, agreed, summary
from tests.support.figures import report
from tests.support.wait import wait_until

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

    def measured(v: dict[int, dict[str, Any] | None]) -> bool:  # a beat before its capacity probe offers no device
        return agreed(v, peers_alive=3) is not None and all(p["devices"] for x in v.values() if x for p in x["peers"])

    view = lab.wait_for(measured, range(4), BOOT_S)
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
    await asyncio.sleep(float(sys.argv[2]))  # the scenario: the forged adverts stay up this long
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


SECURE_SERVE = ["--serve-model", "smollm2-135m", "--serve-weights", "int8"]
MEMBERS = [0, 1, 2, 3]
STRANGER, PLAIN = 4, 5  # another cluster's member; a plaintext (--insecure) agent


def _serving(
    lab: AgentLab, nodes: list[int], timeout: float, settle_s: float = 3.0
) -> tuple[int, dict[str, Any], dict[int, dict[str, Any] | None]]:
    """Wait until the agreed coordinator among ``nodes`` serves a plan made with every node's
    measured speed (the same plan for ``settle_s``): its index, services status and the view."""
    since: tuple[float, Any] | None = None

    def settled() -> tuple[int, dict[str, Any], dict[int, dict[str, Any] | None]] | None:
        nonlocal since
        view = lab.clusters(nodes)
        coord = agreed(view, peers_alive=len(nodes) - 1)
        for i, v in view.items():
            sv = v.get("services") if coord and v and v["node"] == coord else None
            if not sv:
                continue
            assert sv["state"] != "failed", sv["error"]
            measured = all((p["score"] or 0) > 0 for p in v["peers"] if p["alive"])
            if sv["state"] != "serving" or not measured:
                since = None
            elif since is None or since[1] != sv["plan"]:
                since = (time.monotonic(), sv["plan"])
            elif time.monotonic() - since[0] >= settle_s:
                return i, sv, view
        return None

    got = wait_until(
        settled, timeout, what="a settled pipeline", step=0.5, diagnose=lambda: summary(lab.clusters(nodes))
    )
    assert got is not None
    return got


def _answer(lab: AgentLab, i: int, path: str, timeout: float = 20.0) -> dict[str, Any]:
    """GET node ``i``'s status API until it answers (a busy agent on loaded cores may miss one)."""

    def answer() -> dict[str, Any] | None:
        assert lab.alive(i), f"node {i} exited"
        return lab.get(i, path)

    got = wait_until(answer, timeout, what=f"node {i} to answer {path}", ok=lambda g: g is not None, step=0.5)
    assert got is not None
    return got


def test_secure_lab_forms_elects_and_serves_over_mtls_and_ignores_strangers(tmp_path: Path, smollm2: Any) -> None:
    """Issue 26: 'cluster init' on one namespace, 'join' on three others (the real CLI, a token
    naming the first node's LAN address), and the four agents find each other, elect over signed
    datagrams, plan, assign and serve over mutual TLS by themselves. A member of another cluster
    beating at them and a plaintext agent claiming their cluster id are refused, not admitted."""
    env = {"LAKESHARD_SHARED_CACHE": str(cache_dir())}  # the coordinator exports once; stages fetch their files
    speed = cache_dir() / "capacity.json"  # every node the same speed score: the same plan (and cached export)
    with AgentLab(6, tmp_path, split=6, secure=True, agent_args=SECURE_SERVE, env=env, capacity=speed) as lab:
        t0 = time.monotonic()
        lab.start_all(MEMBERS)
        view = lab.wait_for(lambda v: agreed(v, peers_alive=3) is not None, MEMBERS, BOOT_S)
        formed_s = time.monotonic() - t0
        coord, term = agreed(view), view[0]["term"]  # type: ignore[index]
        cid = json.loads(lab.cli(0, "cluster", "status", "--json").stdout)["cluster_id"]
        assert [v["role"] for v in view.values() if v].count("coordinator") == 1
        for i, v in view.items():
            assert v is not None and v["term"] == term and v["cluster"] == cid, summary(view)
            assert v["links"] == "TLS", v
            traffic = v["election_traffic"]
            assert traffic["mode"] == "signed" and traffic["certificates"] >= 3, traffic
            assert set(traffic["refused"]) <= {"unknown_cert"}, traffic  # only certificate learning at start-up
            assert (lab.homes[i] / "config" / "security" / "node.crt").is_file()
            assert lab.get(i, "/v1/node")["links"] == "TLS"  # type: ignore[index]
        homes = {str(lab.homes[i] / "config" / "security") for i in MEMBERS}
        assert len(homes) == 4  # each node its own keys
        out = subprocess.run(
            lab.lan.nodes[2].cmd([sys.executable, "-m", "agent", "status", "--api-port", str(API_PORT)]),
            capture_output=True,
            text=True,
            timeout=60,
            env=lab.home_env(2),
        )
        assert out.returncode == 0, out.stderr
        assert f"in cluster {cid}" in out.stdout and f"coordinator {coord}" in out.stdout
        assert "links to other nodes: TLS, election datagrams signed" in out.stdout, out.stdout

        # the coordinator plans over the four and assigns; a chat through another node's local API answers
        ci, sv, view = _serving(lab, MEMBERS, 240)
        served_s = time.monotonic() - t0
        coord, term = agreed(view), view[ci]["term"]  # type: ignore[index]
        nodes = {v["node"] for v in view.values() if v}
        assert all(v["term"] == term for v in view.values() if v), summary(view)
        assert sv["plan"] and {st["node"] for st in sv["plan"]} <= nodes and sv["term"] == term
        assert sv["plan"][0]["layers"][0] == 0 and sv["plan"][-1]["layers"][1] == 30
        far = next(i for i in MEMBERS if i != ci)
        body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}
        r = lab.ask(far, {"op": "post", "url": f"http://127.0.0.1:{API_PORT}/v1/chat/completions", "body": body,
                          "timeout": 120})  # fmt: skip
        assert r["ok"], r
        answer = r["body"]["choices"][0]["message"]["content"]
        assert answer.strip(), r
        for st in sv["plan"]:
            k = next(i for i in MEMBERS if view[i]["node"] == st["node"])  # type: ignore[index]
            stage = lab.get(k, "/v1/node")["stage"]  # type: ignore[index]
            assert stage["assigned"] and stage["layers"] == st["layers"]
        report(
            f"netns mTLS: 4 agents formed in {formed_s:.1f}s (init, invite, joins in it), "
            f"served at {served_s:.1f}s on {len(sv['plan'])} stage(s)"
        )

        # strangers on the LAN: a member of ANOTHER cluster beating at the four (static peers), and a
        # plaintext agent claiming this cluster's id (found over mDNS); neither serves a model (each
        # would coordinate itself, and compiling on these two shared cores would only starve the lab)
        other = lab.cli(STRANGER, "cluster", "init").stdout.split()[1].rstrip(":")
        assert other != cid
        members = ",".join(f"{lab.lan.nodes[i].ip}:{DATA_PORT}" for i in MEMBERS)
        lab.start(STRANGER, extra=["--static-peers", members], agent_args=[])
        lab.start(PLAIN, insecure=True, extra=["--cluster", cid], agent_args=[])
        strangers = {lab.wait_up(k, BOOT_S)["node"] for k in (STRANGER, PLAIN)}

        def refused(v: dict[int, dict[str, Any] | None]) -> bool:
            return all(
                x is not None and {"other_cluster", "unsigned"} <= set(x["election_traffic"]["refused"])
                for x in v.values()
            )

        lab.wait_for(refused, MEMBERS, 60)
        # a window, not a wait: a few more rounds of their beats (and elections of their own), none taken
        time.sleep(3.0)
        view = lab.wait_for(lambda v: agreed(v, peers_alive=3) is not None, MEMBERS, ELECT_S)
        assert agreed(view) == coord
        for v in view.values():
            assert v is not None and v["term"] == term, summary(view)
            alive = {p["node"] for p in v["peers"] if p["alive"]}
            assert alive == nodes - {v["node"]}, v["peers"]
            assert not strangers & alive
            refusals = v["election_traffic"]["refused"]
            assert refusals["other_cluster"] >= 1 and refusals["unsigned"] >= 1, refusals
        plain = _answer(lab, PLAIN, "/v1/cluster")
        assert plain["links"] == "PLAINTEXT"
        assert plain["election_traffic"]["mode"] == "plaintext"
        assert plain["election_traffic"]["refused"].get("signed", 0) >= 1  # the members' beats mean nothing to it
        assert not [p for p in plain["peers"] if p["alive"]]
        foreign = _answer(lab, STRANGER, "/v1/cluster")
        assert foreign["cluster"] == other and foreign["links"] == "TLS"
        assert not [p for p in foreign["peers"] if p["alive"]]
        sv2 = _answer(lab, ci, "/v1/cluster")["services"]
        assert sv2["state"] == "serving" and sv2["plan"] == sv["plan"] and sv2["term"] == term
        r = lab.ask(far, {"op": "post", "url": f"http://127.0.0.1:{API_PORT}/v1/chat/completions", "body": body,
                          "timeout": 120})  # fmt: skip
        assert r["ok"] and r["body"]["choices"][0]["message"]["content"] == answer, r
        log = "".join(f.read_text(errors="replace") for f in (lab.homes[0] / "logs").glob("agent*.log"))
        assert "is not ours" in log  # the other cluster's advertisement, ignored at discovery
