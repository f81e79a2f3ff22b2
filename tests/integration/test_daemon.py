"""One agent daemon on loopback: its status API, the pause switch, and term fencing on the data plane."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent.cluster.elector import Peer
from agent.cluster.offers import NodeOffer
from agent.common.config import Settings
from agent.node.daemon import DaemonOptions, running
from agent.protocol import Assign, Beat, DeviceOffer, Error, decode, encode
from agent.protocol.status import ClusterStatus, NodeStatus, PauseReason
from tests.support.wait import async_wait_until


async def _cluster(http: aiohttp.ClientSession, api: str) -> dict[str, Any]:
    async with http.get(f"{api}/v1/cluster") as r:
        c: dict[str, Any] = await r.json()
        return c


async def test_status_api_pause_switch_and_fencing(isolated_home: Path) -> None:
    settings = Settings(cluster_id="solo", port=0, api_port=0, mdns=False)
    opts = DaemonOptions(host="127.0.0.1", device="CPU", throttle=False, insecure=True)
    async with running(settings, opts) as d, aiohttp.ClientSession() as http:
        api = f"http://127.0.0.1:{d.api_port}"
        cluster = await async_wait_until(  # alone, it is a majority of one
            lambda: _cluster(http, api), 15, what="it to coordinate", ok=lambda c: c["role"] == "coordinator", step=0.1
        )
        assert cluster["coordinator"] == d.node and int(cluster["term"]) >= 1  # type: ignore[call-overload]
        async with http.get(f"{api}/v1/node") as r:
            node = await r.json()
        assert node["node"] == d.node and node["cluster"] == "solo" and node["mem_total"] > 0
        assert (isolated_home / "state" / "term.json").is_file()

        # bad requests get a clear 400 and change nothing
        for body in (b"not json", b'{"state": "asleep"}', b"[1, 2]"):
            async with http.post(f"{api}/v1/node/state", data=body) as r:
                assert r.status == 400 and "state" in (await r.json())["error"]["message"]
        async with http.post(f"{api}/v1/node/state", json={"state": "paused"}) as r:
            paused = NodeStatus.parse(await r.json())  # the typed answer reads back
            assert r.status == 200 and paused.state == "paused"
            assert paused.reason == "user" and paused.reason_kind is PauseReason.SWITCH  # the user's own switch
        cluster = await async_wait_until(
            lambda: _cluster(http, api), 10, what="it to step down", ok=lambda c: c["role"] != "coordinator", step=0.1
        )
        assert cluster["role"] == "follower" and cluster["not_eligible_because"] == "paused"
        assert ClusterStatus.parse(cluster).reason_kind is PauseReason.SWITCH

        # an assignment from a term older than the election's is refused on the data plane
        assign = Assign(
            term=0,
            export_id="x",
            stage=0,
            stages=1,
            manifest_sha256="0" * 64,
            artifacts_url="http://127.0.0.1:1/",
            local_dir=None,
            next_hop="ws://127.0.0.1:1/ret",
        )
        async with http.ws_connect(f"ws://127.0.0.1:{d.me.port}/ws") as ws:
            await ws.send_bytes(encode(assign))
            err, _ = decode(await ws.receive_bytes(timeout=10))
        assert isinstance(err, Error) and err.code == "stale_term"

        # pinned to the CPU, it offers the CPU only, and refuses a stage on another device
        await async_wait_until(lambda: d.capacity, 30, what="its capacity probe", ok=lambda c: c is not None, step=0.1)
        assert [o.name for o in d.me.offers] == ["CPU"] and d.me.offers[0].score > 0
        async with http.get(f"{api}/v1/node") as r:
            detail = (await r.json())["devices_detail"]
        assert [x["name"] for x in detail] == ["CPU"] and detail[0]["mem_free"] > 0 and not detail[0]["own_memory"]
        assert [(m.offer.node, m.offer.device) for m in d._members()] == [(d.node, "CPU")]
        # peers: one NodeOffer per device a beat offers; a peer without offers (older) offers its node
        e = d.elector
        assert e is not None
        gb = 1024**3
        new = Beat(
            "solo", "igpu", 7, 1, "follower", None, "available", True, 300.0, 6 * gb, 16 * gb, ("CPU", "GPU"), "0"
        )
        new = replace(new, offers=(DeviceOffer("CPU", 100.0, 6 * gb), DeviceOffer("GPU", 300.0, 6 * gb)))
        old = Beat("solo", "old", 8, 1, "follower", None, "limited", True, 0.0, 2 * gb, 4 * gb, ("CPU",), "0")
        for b in (new, old):
            e.peers[b.node] = Peer(b.node, ("127.0.0.2", b.port), last_heard=time.monotonic(), beat=b)
        offers = {(m.offer.node, m.offer.device): (m.offer, m.address, m.measured) for m in d._members()}
        assert offers[("igpu", "GPU")] == (NodeOffer("igpu", 6 * gb, 300.0, "available", "GPU"), "127.0.0.2:7", True)
        assert offers[("igpu", "CPU")][0] == NodeOffer("igpu", 6 * gb, 100.0, "available", "CPU")
        assert offers[("old", "")] == (NodeOffer("old", 2 * gb, 1.0, "limited"), "127.0.0.2:8", False)
        assert len(offers) == 4
        for b in (new, old):
            del e.peers[b.node]
        term = d.host.term_seen
        async with http.ws_connect(f"ws://127.0.0.1:{d.me.port}/ws") as ws:
            await ws.send_bytes(encode(replace(assign, term=term + 5, device="GPU")))
            err, _ = decode(await ws.receive_bytes(timeout=10))
        assert isinstance(err, Error) and err.code == "bad_device"
        assert "pinned to device CPU" in err.message and "asks for GPU" in err.message
        assert d.host.term_seen == term


async def test_agents_on_other_ports_of_one_machine_each_keep_their_own_node_id(isolated_home: Path) -> None:
    """Two agents sharing a machine (and its state folder) but not a port are two nodes; each
    keeps its id across a restart, and the one on the default port keeps the plain folder."""
    from coordinator.lab.local_cluster import free_port

    # (numbers picked before the daemons bind them: a configured port names the state folder, so the
    # id, and the restart must find the same number; port 0 would mean the plain folder)
    ports = [free_port(), free_port()]
    opts = DaemonOptions(host="127.0.0.1", device="CPU", throttle=False, standalone=True, insecure=True)

    async def ids() -> list[str]:
        got = []
        for port in ports:
            settings = Settings(cluster_id="two", port=port, api_port=0, mdns=False)
            async with running(settings, opts) as d, aiohttp.ClientSession() as http:
                r = await http.get(f"http://127.0.0.1:{d.api_port}/v1/node")
                got.append((await r.json())["node"])
        return got

    first = await ids()
    assert first[0] != first[1]
    assert await ids() == first  # restarted: the same ids
    assert {p.name for p in (isolated_home / "state").iterdir()} >= {f"port-{p}" for p in ports}


def test_each_agent_process_writes_its_own_log_file(isolated_home: Path) -> None:
    """An agent on another data port keeps its state and its log apart from the default one's:
    its corrupt term file stops only it, and says so in its own log file."""
    from coordinator.lab.local_cluster import free_port
    from tests.support.cli import run_cli

    port = free_port()  # (only a number: the agent stops at its corrupt term file before it binds)
    (isolated_home / "state" / f"port-{port}").mkdir(parents=True)
    (isolated_home / "state" / f"port-{port}" / "term.json").write_text("{garbage")
    r = run_cli(
        "agent",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-port",
        "0",
        "--no-mdns",
        "--device",
        "CPU",
        "--insecure",
    )
    assert r.returncode == 2 and f"port-{port}" in r.stderr and "term.json is corrupt" in r.stderr
    log = (isolated_home / "logs" / f"agent-{port}.log").read_text()
    assert f"agent-{port}[" in log  # every line says which process wrote it
    assert not (isolated_home / "logs" / "agent.log").exists()


def test_a_corrupt_term_file_stops_the_agent_with_a_clear_error(isolated_home: Path) -> None:
    from tests.support.cli import run_cli

    (isolated_home / "state").mkdir(parents=True)
    (isolated_home / "state" / "term.json").write_text("{garbage")
    r = run_cli(
        "agent", "--host", "127.0.0.1", "--port", "0", "--api-port", "0", "--no-mdns", "--device", "CPU", "--insecure"
    )
    assert r.returncode == 2 and "term.json is corrupt" in r.stderr and "Traceback" not in r.stderr


pytestmark = pytest.mark.timeout(120)
