"""``lakeshard agent`` leaves within 2 s of SIGTERM or SIGINT, and so does the tray's Quit (issue 37).

A laptop that shuts down gives its programs a few seconds. Real agent processes on loopback:
a 2-agent elected cluster serving SmolLM2 loses its stage-only agent in the middle of an answer
(gone within 2 s, and its peer no longer counts it live a few seconds later), then its
coordinator in the middle of an answer (gone within 2 s, the answer ends with an error chunk,
not a cut connection); agents that serve nothing, or wait for a cluster, leave as fast; the tray
quits within 2 s and takes the agent it started with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from coordinator.lab.local_cluster import LocalCluster, free_port
from tests.support.cli import REPO
from tests.support.figures import report
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(900)
EXIT_S = 2.0  # what a laptop shutting down leaves a program (the bound)
# a long answer at temperature 0, so that it is still streaming when the agents get their signal
COUNT = "Count from 1 to 500, one number per line, with nothing else."


def _get(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        d: dict[str, Any] = json.loads(r.read())
        return d


def _found(v: Any) -> bool:
    """What the waits below accept: neither None nor False (an agent's index may be 0)."""
    return v is not None and v is not False


ANSWERING = (OSError,)  # an agent that does not answer yet: not yet, for the waits below


def _signal(proc: subprocess.Popen[Any], sig: signal.Signals = signal.SIGTERM) -> float:
    """Send ``sig``; the seconds until the process is gone (a generous wait: the test says what is too slow)."""
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return time.monotonic() - t0


def _logs(c: LocalCluster, lines: int = 30) -> str:
    """The last lines of every agent's log, for a failure's message."""
    out = []
    for i in range(c.n):
        for f in sorted((c.home(i) / "logs").glob("*.log")):
            out.append(f"--- {f.name}")
            out += f.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(out)


class Answer(threading.Thread):
    """A streamed chat answer, read event by event in a thread, and how it ended."""

    def __init__(self, api_port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{api_port}/v1/chat/completions"
        self.pieces = 0  # content chunks so far
        self.ended: str | None = None  # "done", "error <code>", or how the connection was cut
        self.finished = threading.Event()
        self.start()

    def run(self) -> None:
        body = {"messages": [{"role": "user", "content": COUNT}], "max_tokens": 1500, "temperature": 0, "stream": True}
        req = urllib.request.Request(self.url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.ended = self.ended or "done"
                        continue
                    ev = json.loads(line[len("data: ") :])
                    if "error" in ev:
                        self.ended = f"error {ev['error'].get('code')}"
                    elif ev["choices"] and ev["choices"][0]["delta"].get("content"):
                        self.pieces += 1
            self.ended = self.ended or "closed with neither [DONE] nor an error chunk"
        except Exception as e:  # a reset, or http.client.IncompleteRead: the connection was cut
            self.ended = self.ended or f"cut: {type(e).__name__}: {e}"
        finally:
            self.finished.set()

    def streaming(self) -> bool:
        return self.pieces > 0 and not self.finished.is_set()


def _live_peers(port: int) -> set[str]:
    return {p["node"] for p in _get(port, "/v1/cluster")["peers"] if p["alive"]}


def test_a_serving_cluster_s_agents_leave_within_2s_of_sigterm_in_the_middle_of_an_answer(
    smollm2: Any, tmp_path: Path
) -> None:
    elect = ["--serve-model", "smollm2-135m", "--serve-weights", "int8", "--serve-api-port", str(free_port())]
    with LocalCluster(2, elect=elect, config="serve:\n  min_nodes: 2\n", log_dir=tmp_path) as c:

        def coordinator() -> int | None:
            for i, port in enumerate(c.api_ports):
                sv = _get(port, "/v1/cluster").get("services")
                if sv and sv["state"] == "serving" and len(sv["plan"]) == 2:
                    return i
            return None

        coord: int = wait_until(
            coordinator,
            600,
            what="the cluster to serve on both agents",
            ok=_found,
            step=0.5,
            ignore=ANSWERING,
            diagnose=lambda: _logs(c),
        )
        stage = 1 - coord
        stage_node = _get(c.api_ports[stage], "/v1/node")["node"]
        assert stage_node in _live_peers(c.api_ports[coord])

        # the stage-only agent, in the middle of an answer (through the coordinator laptop's own agent)
        a = Answer(c.api_ports[coord])
        wait_until(a.streaming, 120, what="the answer's first words", ok=_found, step=0.1, ignore=ANSWERING)
        took = _signal(c.procs[stage])
        t0 = time.monotonic()
        assert took < EXIT_S, f"the stage-only agent took {took:.2f} s to exit\n{_logs(c)}"
        wait_until(
            lambda: stage_node not in _live_peers(c.api_ports[coord]),
            5,
            what="the coordinator to count the stage's agent gone",
            ok=_found,
            step=0.05,
            ignore=ANSWERING,
        )
        seen_gone = time.monotonic() - t0 + took

        # the coordinator, in the middle of an answer (the one above, resumed by the failover, or a new one)
        before = a.pieces
        wait_until(
            lambda: a.finished.is_set() or a.pieces > before + 2,
            180,
            what="the answer to go on or end",
            ok=_found,
            step=0.1,
            ignore=ANSWERING,
        )
        first = "resumed by the failover" if a.streaming() else f"ended ({a.ended})"
        b = a if a.streaming() else Answer(c.api_ports[coord])
        wait_until(b.streaming, 120, what="an answer's first words", ok=_found, step=0.1, ignore=ANSWERING)
        took_coord = _signal(c.procs[coord])
        assert took_coord < EXIT_S, f"the coordinator's agent took {took_coord:.2f} s to exit\n{_logs(c)}"
        assert b.finished.wait(10), "the answer in flight did not end with the coordinator"
        assert b.ended == "error shutdown", f"the answer in flight ended: {b.ended}"
        report(
            f"SIGTERM mid-answer: stage-only agent gone in {took:.2f} s (its peer counted it gone "
            f"{seen_gone:.2f} s after the signal; the answer {first}), coordinator agent gone in {took_coord:.2f} s "
            "(the answer in flight ended with an error chunk)"
        )


def test_agents_that_serve_nothing_leave_within_2s_of_sigterm_and_sigint() -> None:
    with LocalCluster(2, elect=[]) as c:

        def elected() -> int | None:
            nodes = [_get(p, "/v1/node") for p in c.api_ports]
            leaders = {n["coordinator"] for n in nodes}
            if len(leaders) != 1 or None in leaders:
                return None
            return next(i for i, n in enumerate(nodes) if n["node"] == n["coordinator"])

        coord = wait_until(elected, 60, what="a coordinator", ok=_found, step=0.1, ignore=ANSWERING)
        other = 1 - coord
        node = _get(c.api_ports[other], "/v1/node")["node"]
        took = _signal(c.procs[other], signal.SIGTERM)
        assert took < EXIT_S, f"the follower took {took:.2f} s to exit on SIGTERM"
        wait_until(
            lambda: node not in _live_peers(c.api_ports[coord]),
            5,
            what="its peer to count it gone",
            ok=_found,
            step=0.05,
            ignore=ANSWERING,
        )
        took_coord = _signal(c.procs[coord], signal.SIGINT)
        assert took_coord < EXIT_S, f"the coordinator took {took_coord:.2f} s to exit on SIGINT"
        report(f"SIGTERM/SIGINT, no model: follower gone in {took:.2f} s, coordinator in {took_coord:.2f} s")


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "LAKESHARD_HOME": str(home)}


def test_an_agent_waiting_for_a_cluster_leaves_within_2s_of_sigterm(tmp_path: Path) -> None:
    api = free_port()
    cmd = [sys.executable, "-m", "agent", "agent", "--api-port", str(api), "--port", str(free_port()), "--no-mdns"]
    p = subprocess.Popen(cmd, env=_env(tmp_path), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(
            lambda: _get(api, "/v1/node")["state"] == "no_cluster",
            60,
            what="its local API",
            ok=_found,
            step=0.1,
            ignore=ANSWERING,
        )
        took = _signal(p)
        assert took < EXIT_S, f"an agent waiting for a cluster took {took:.2f} s to exit"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_tray_quits_within_2s_and_stops_the_agent_it_started(tmp_path: Path) -> None:
    # SIGTERM takes the same way out as the menu's Quit (both end the tray's main loop)
    api = free_port()
    cmd = [sys.executable, "-m", "agent", "tray", "--api-port", str(api)]
    cmd += ["--agent-arg=--no-mdns", "--agent-arg=--insecure", "--agent-arg=--port", f"--agent-arg={free_port()}"]
    env = {**_env(tmp_path), "QT_QPA_PLATFORM": "offscreen"}
    tray = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(tray.stdout or ()), daemon=True).start()
    agents: list[psutil.Process] = []
    try:
        wait_until(
            lambda: _get(api, "/v1/node")["node"],
            90,
            what="the agent the tray started",
            ok=_found,
            step=0.1,
            ignore=ANSWERING,
        )
        agents = [c for c in psutil.Process(tray.pid).children() if "agent" in c.cmdline()]
        assert len(agents) == 1
        wait_until(
            lambda: any("following the agent" in line for line in out),
            30,
            what="the tray to follow it",
            ok=_found,
            step=0.1,
            ignore=ANSWERING,
        )
        took = _signal(tray)
        assert took < EXIT_S, f"the tray took {took:.2f} s to quit\n{''.join(out)}"
        assert not agents[0].is_running() or agents[0].status() == psutil.STATUS_ZOMBIE, "the tray left its agent"
        report(f"tray Quit (SIGTERM): tray and its agent gone in {took:.2f} s")
    finally:
        for p in agents:
            if p.is_running():
                p.kill()
        if tray.poll() is None:
            tray.kill()
            tray.wait()
