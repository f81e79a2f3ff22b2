"""One agent daemon on loopback: its status API, the pause switch, and term fencing on the data plane."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from agent.config import Settings
from agent.daemon import DaemonOptions, running
from agent.protocol import Assign, Error, decode, encode


async def _until_coordinator(http: aiohttp.ClientSession, api: str, timeout: float = 15.0) -> dict[str, object]:
    end = asyncio.get_running_loop().time() + timeout
    while True:
        async with http.get(f"{api}/v1/cluster") as r:
            c: dict[str, object] = await r.json()
        if c["role"] == "coordinator":
            return c
        assert asyncio.get_running_loop().time() < end, c
        await asyncio.sleep(0.1)


async def test_status_api_pause_switch_and_fencing(isolated_home: Path) -> None:
    settings = Settings(cluster_id="solo", port=0, api_port=0, mdns=False)
    opts = DaemonOptions(host="127.0.0.1", device="CPU", throttle=False)
    async with running(settings, opts) as d, aiohttp.ClientSession() as http:
        api = f"http://127.0.0.1:{d.api_port}"
        cluster = await _until_coordinator(http, api)  # alone, it is a majority of one
        assert cluster["coordinator"] == d.node and int(cluster["term"]) >= 1  # type: ignore[call-overload]
        async with http.get(f"{api}/v1/node") as r:
            node = await r.json()
        assert node["node"] == d.node and node["cluster"] == "solo" and node["mem_total"] > 0
        assert (isolated_home / "state" / "term.json").is_file()

        # bad requests get a clear 400 and change nothing
        for body in (b"not json", b'{"state": "asleep"}', b"[1, 2]"):
            async with http.post(f"{api}/v1/node/state", data=body) as r:
                assert r.status == 400 and "state" in (await r.json())["error"]
        async with http.post(f"{api}/v1/node/state", json={"state": "paused"}) as r:
            assert r.status == 200 and (await r.json())["state"] == "paused"
        for _ in range(100):
            async with http.get(f"{api}/v1/cluster") as r:
                cluster = await r.json()
            if cluster["role"] != "coordinator":
                break
            await asyncio.sleep(0.1)
        assert cluster["role"] == "follower" and cluster["not_eligible_because"] == "paused"

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


def test_a_corrupt_term_file_stops_the_agent_with_a_clear_error(isolated_home: Path) -> None:
    from tests.conftest import run_cli

    (isolated_home / "state").mkdir(parents=True)
    (isolated_home / "state" / "term.json").write_text("{garbage")
    r = run_cli("agent", "--host", "127.0.0.1", "--port", "0", "--api-port", "0", "--no-mdns", "--device", "CPU")
    assert r.returncode == 2 and "term.json is corrupt" in r.stderr and "Traceback" not in r.stderr


pytestmark = pytest.mark.timeout(120)
