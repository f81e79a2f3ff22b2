"""The agent yields to its laptop's user: real input on a real X server (Xvfb + xdotool), and a
stand-in heat source (a sensors file; this machine has no thermal zones), against real agents.

Skipped where Xvfb or xdotool is missing (``.ci/run`` installs them), saying so.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from coordinator.lab.local_cluster import LocalCluster, free_port
from tests.support.cli import REPO
from tests.support.figures import report
from tests.support.served import post_chat
from tests.support.wait import wait_until
from tests.support.xserver import missing, touch, xvfb

TOOLS = missing("Xvfb", "xdotool")
pytestmark = [
    pytest.mark.skipif(bool(TOOLS), reason=f"needs {', '.join(TOOLS)} (apt-get install xvfb xdotool libxss1)"),
    pytest.mark.timeout(900),
]
QUICK = (
    "throttle:\n  idle_minutes: 0.05\n  min_dwell_s: 0.5\n  cpu_high_pct: off\n  gpu_high_pct: off\n"  # 3 s idle: back
)


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as r:
        d: dict[str, Any] = json.loads(r.read())
        return d


def test_input_pauses_the_agent_within_a_second_and_idling_brings_it_back(tmp_path: Path) -> None:
    with xvfb() as env:
        (tmp_path / "home" / "config").mkdir(parents=True)
        cfg = tmp_path / "home" / "config" / "config.yaml"
        cfg.write_text(QUICK)
        port, api = free_port(), free_port()
        cmd = [
            sys.executable,
            "-m",
            "agent",
            "agent",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--api-port",
            str(api),
        ]
        cmd += ["--no-mdns", "--device", "CPU", "--insecure"]  # a lone agent: no cluster to join
        env = {**env, "LAKESHARD_HOME": str(tmp_path / "home"), "PYTHONWARNINGS": "ignore"}
        agent = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{api}/v1/node"
        try:
            wait_until(lambda: _try(url), 60, what="the agent")
            node = wait_until(lambda: _try(url), 30, what="an idle display", ok=lambda n: n and _idle(n))
            assert node["throttle"]["sources"]["idle"] == "XScreenSaver"
            stops, backs = [], []
            for trial in range(3):
                t0 = time.monotonic()
                touch(env, 20 + trial * 7, 30)
                paused = wait_until(
                    lambda: _try(url), 5, what="paused", ok=lambda n: n and n["state"] == "paused", step=0.02
                )
                stops.append(time.monotonic() - t0)
                assert paused["reason"] == "user active" and paused["throttle"]["readings"]["idle_s"] < 2
                assert paused["reason_kind"] == "input"  # the typed kind: its user, not the machine
                wait_until(
                    lambda: _try(url),
                    15,
                    what="available again",
                    ok=lambda n: n and n["state"] == "available",
                    step=0.05,
                )
                backs.append(time.monotonic() - t0)
            assert max(stops) < 1.0, stops
            assert all(2.8 < b < 8.0 for b in backs), backs  # idle_minutes 0.05 = 3 s, then a 0.5 s dwell
            report(
                f"throttle: input -> paused in {', '.join(f'{s * 1000:.0f}' for s in stops)} ms; back after "
                f"{', '.join(f'{b:.1f}' for b in backs)} s idle"
            )
        finally:
            agent.terminate()
            agent.wait(15)


def _idle(n: dict[str, Any]) -> bool:
    r = n["throttle"]["readings"]
    return n["state"] == "available" and r is not None and r["idle_s"] is not None and r["idle_s"] >= 3


def _try(url: str) -> dict[str, Any] | None:
    try:
        return _get(url)
    except OSError:
        return None


def _stream(api: str, prompt: str, max_tokens: int, out: list[tuple[float, str]]) -> None:
    """One streamed answer through ``api``; its text pieces with their arrival times."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    req = urllib.request.Request(
        f"{api}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                for ch in json.loads(line[6:]).get("choices", []):
                    if ch["delta"].get("content"):
                        out.append((time.monotonic(), ch["delta"]["content"]))


def test_a_stage_node_paused_by_its_user_or_by_heat_hands_its_work_back_without_losing_text(
    smollm2: Any, tmp_path: Path
) -> None:
    prompt = "Write a long story about a lighthouse keeper and a storm."
    fake = tmp_path / "sensors.json"
    fake.write_text("{}")
    with xvfb() as xenv:
        envs = [{}, {}, {"DISPLAY": xenv["DISPLAY"], "LAKESHARD_FAKE_SENSORS": str(fake)}]
        elect = ["--serve-model", "smollm2-135m", "--serve-weights", "int8", "--serve-exact"]
        spread = QUICK + "serve:\n  min_nodes: 3\n"  # all three serve, whatever the speed probes say
        never_coordinate = spread + "election:\n  min_coordinator_memory_gb: 4096\n"  # a stage node only
        c = LocalCluster(
            3, elect=elect, throttle=True, config=[spread, spread, never_coordinate], agent_envs=envs
        ).start()
        try:
            apis = [f"http://127.0.0.1:{p}" for p in c.api_ports]
            victim = apis[2]
            me = _get(f"{victim}/v1/node")["node"]

            def serving_on_all() -> bool:
                try:
                    cl = _get(f"{apis[0]}/v1/cluster")
                    coord = next((a for a in apis if _get(f"{a}/v1/cluster").get("services")), None)
                    sv = _get(f"{coord}/v1/cluster")["services"] if coord else None
                except OSError:
                    return False
                return bool(sv and sv["state"] == "serving" and len(sv["plan"]) == 3 and cl["coordinator"])

            wait_until(serving_on_all, 600, what="three stages serving", step=0.5)
            coord = next(a for a in apis if _get(f"{a}/v1/cluster").get("services"))
            status, plain = post_chat(
                coord, {"messages": [{"role": "user", "content": prompt}], "max_tokens": 160, "temperature": 0}
            )
            assert status == 200
            reference = plain["choices"][0]["message"]["content"]

            for how in ("input", "heat"):
                wait_until(serving_on_all, 120, what="three stages again", step=0.5)
                pieces: list[tuple[float, str]] = []
                t = threading.Thread(target=_stream, args=(coord, prompt, 160, pieces))
                t.start()
                wait_until(lambda p=pieces: len(p) >= 20, 120, what="a few tokens", step=0.02)  # type: ignore[misc]
                t0 = time.monotonic()
                if how == "input":
                    touch(xenv, 50, 60)
                else:
                    fake.write_text(json.dumps({"temp_c": 95.0}))
                paused = wait_until(
                    lambda: _get(f"{victim}/v1/node"),
                    5,
                    what="the pause",
                    ok=lambda n: n["state"] == "paused",
                    step=0.02,
                )
                assert paused["reason"] == ("user active" if how == "input" else "95 C")
                assert paused["reason_kind"] == ("input" if how == "input" else "heat")
                t.join(600)
                text = "".join(p for _, p in pieces)
                assert text == reference, how
                frames = _get(f"{victim}/v1/node")["stage"]["frames"]
                time.sleep(1.0)  # a window, not a wait: a paused stage computes no frame in it
                assert _get(f"{victim}/v1/node")["stage"]["frames"] == frames  # its compute thread stopped
                resumed = next((ts for ts, _ in pieces if ts > t0), None)
                report(
                    f"throttle ({how}): stage node {me} paused {paused['reason']!r}; text identical; "
                    f"next token {0 if resumed is None else resumed - t0:.1f} s after the trigger"
                )
                if how == "heat":
                    fake.write_text(json.dumps({"temp_c": 60.0}))
                wait_until(
                    lambda: _get(f"{victim}/v1/node"),
                    30,
                    what="the node back",
                    ok=lambda n: n["state"] == "available",
                    step=0.1,
                )
        finally:
            c.stop()
