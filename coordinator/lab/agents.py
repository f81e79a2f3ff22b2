"""Agents on a namespace LAN (:mod:`coordinator.lab.netns`): start, kill, restart, and watch them.

Each node runs the real ``lakeshard agent`` in its own namespace with its own
``LAKESHARD_HOME`` (so its own node id, term, logs and ``config/security`` folder). A plaintext
lab (the default) starts every agent ``--insecure``; a secure lab (``secure=True``) forms a real
cluster first with the user's commands, each run inside its node's namespace and home:
``lakeshard cluster init`` on the first node, its agent started, ``cluster invite`` there (the
token names that node's LAN address), ``cluster join TOKEN`` on every other node, then their
agents: node links are mutual TLS and election datagrams are signed.

An agent's status API listens on its namespace's 127.0.0.1, so each namespace also gets a
small long-lived probe process that relays requests (HTTP to the status API, or a UDP
datagram to any address, for forged messages) and answers with one JSON line.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from agent.security.files import NODE_CERT
from coordinator.lab.netns import Lan

API_PORT = 7701
DATA_PORT = 7700
BOOT_S = 90.0  # an agent importing OpenVINO while others do, on two cores


class LabError(RuntimeError):
    pass


_PROBE = r"""
import base64, json, socket, sys, urllib.request
for line in sys.stdin:
    q = json.loads(line)
    try:
        if q["op"] == "get":
            with urllib.request.urlopen(q["url"], timeout=q.get("timeout", 3)) as r:
                out = {"ok": True, "body": json.loads(r.read())}
        elif q["op"] == "post":
            req = urllib.request.Request(q["url"], data=json.dumps(q["body"]).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=q.get("timeout", 3)) as r:
                out = {"ok": True, "body": json.loads(r.read())}
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("0.0.0.0", q.get("from_port", 0)))
            s.settimeout(q.get("wait", 1.0))
            s.sendto(base64.b64decode(q["data"]), (q["host"], q["port"]))
            try:
                out = {"ok": True, "reply": base64.b64encode(s.recv(65536)).decode()}
            except socket.timeout:
                out = {"ok": True, "reply": None}
            s.close()
    except Exception as e:
        out = {"ok": False, "error": repr(e)}
    print(json.dumps(out), flush=True)
"""


class AgentLab:
    def __init__(
        self,
        n: int,
        home_root: Path,
        *,
        cluster: str = "lab",
        split: int | None = None,
        agent_args: Sequence[str] = (),
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
        secure: bool = False,
        capacity: Path | None = None,
    ) -> None:
        """``secure``: agents use the cluster credentials in their homes (see :meth:`form_secure`);
        otherwise every agent starts ``--insecure`` (plaintext links, unsigned datagrams) and
        ``cluster`` is its cluster id. A secure agent's cluster id is its certificate's.
        ``capacity``: a ``capacity.json`` copied into every home before its agent first starts, so
        every node reuses the same speed score (identical laptops: the same plan, hence the same
        cached export, every run) instead of measuring itself on cores its neighbours load."""
        self.lan = Lan(n, split)
        self.secure, self.capacity = secure, capacity
        self.marks: dict[str, float] = {}  # when form_secure's steps ended (time.monotonic())
        self.home_root, self.cluster, self.agent_args = home_root, cluster, list(agent_args)
        self.log_dir = log_dir or home_root
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self.probes: list[subprocess.Popen[str] | None] = [None] * n
        self.homes = [home_root / f"node{i}" for i in range(n)]
        self.env = env or {}
        self.spawned_at = [0.0] * n

    def __enter__(self) -> AgentLab:
        self.lan.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    @property
    def n(self) -> int:
        return self.lan.n

    # -- agents ----------------------------------------------------------------------------------
    def home_env(self, i: int) -> dict[str, str]:
        """The environment of node ``i``'s processes: its own home (config, security folder, state)."""
        return {**os.environ, "LAKESHARD_HOME": str(self.homes[i]), "PYTHONWARNINGS": "ignore", **self.env}

    def start(
        self,
        i: int,
        *,
        fresh: bool = False,
        extra: Sequence[str] = (),
        insecure: bool | None = None,
        agent_args: Sequence[str] | None = None,
    ) -> None:
        """Start node ``i``'s agent (``fresh``: with a new home, so a new node id; ``insecure``:
        plaintext whatever its home holds, default: unless the lab is secure; ``agent_args``:
        instead of the lab's)."""
        if fresh:
            self.homes[i] = self.home_root / f"node{i}-{time.monotonic_ns()}"
        plain = not self.secure if insecure is None else insecure
        if not plain and not (self.homes[i] / "config" / "security" / NODE_CERT).is_file():
            raise LabError(
                f"node {i} has no cluster credentials in {self.homes[i]}: form the cluster (start_all), "
                "'lakeshard cluster init/join' there (cli), or start it insecure=True"
            )
        seeded = self.homes[i] / "cache" / "capacity.json"
        if self.capacity is not None and self.capacity.is_file() and not seeded.exists():
            seeded.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.capacity, seeded)
        cmd = [sys.executable, "-m", "agent", "agent", "--port", str(DATA_PORT)]
        cmd += ["--api-port", str(API_PORT), "--device", "CPU", "--threads", "1", "--throttle", "off"]
        cmd += ["--cluster", self.cluster, "--insecure"] if plain else []
        # (the other "laptops" here are this machine's programs: no throttle)
        cmd += [*(self.agent_args if agent_args is None else agent_args), *extra]
        log = open(self.log_dir / f"agent{i}.log", "ab")  # noqa: SIM115 (the child owns it)
        self.spawned_at[i] = time.time()
        self.procs[i] = subprocess.Popen(
            self.lan.nodes[i].cmd(cmd), env=self.home_env(i), stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def start_all(self, nodes: Sequence[int] | None = None) -> None:
        """Start these nodes' agents (default: all); a secure lab forms its cluster first."""
        nodes = list(range(self.n) if nodes is None else nodes)
        if self.secure:
            self.form_secure(nodes)
            return
        for i in nodes:
            self.start(i)

    # -- cluster credentials ------------------------------------------------------------------
    def cli(self, i: int, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run ``lakeshard ARGS`` in node ``i``'s namespace and home; raises LabError if it fails."""
        p = subprocess.run(
            self.lan.nodes[i].cmd([sys.executable, "-m", "agent", *args]),
            env=self.home_env(i),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if p.returncode != 0:
            raise LabError(f"node {i}: lakeshard {' '.join(args[:2])} failed: {(p.stderr or p.stdout).strip()[-500:]}")
        return p

    def wait_up(self, i: int, timeout: float) -> dict[str, Any]:
        """Wait until node ``i``'s agent answers on its status API (its data port listens by then)."""
        deadline = time.monotonic() + timeout
        while True:
            node = self.get(i, "/v1/node")
            if node is not None:
                return node
            if not self.alive(i):
                raise LabError(f"node {i}'s agent exited ({self.log_dir / f'agent{i}.log'})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {i}'s agent did not answer within {timeout:.0f}s")
            time.sleep(0.2)

    def form_secure(self, nodes: Sequence[int], timeout: float = BOOT_S) -> str:
        """Make a cluster the way a user does and start its agents: ``cluster init`` on the first
        of ``nodes``, its agent, ``cluster invite`` there for the others (through its LAN address),
        ``cluster join`` on each of them at once, then their agents. Returns the cluster id."""
        first, rest = nodes[0], list(nodes[1:])
        out = self.cli(first, "cluster", "init").stdout
        cid = out.split()[1].rstrip(":")
        self.start(first)
        self.wait_up(first, timeout)
        self.marks["first_up"] = time.monotonic()
        if rest:
            address = f"{self.lan.nodes[first].ip}:{DATA_PORT}"
            token = self.cli(
                first, "cluster", "invite", "--uses", str(len(rest)), "--expires", "30m", "--address", address
            ).stdout.strip()
            joins = {
                i: subprocess.Popen(
                    self.lan.nodes[i].cmd([sys.executable, "-m", "agent", "cluster", "join", token]),
                    env=self.home_env(i),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for i in rest
            }
            for i, p in joins.items():
                said, _ = p.communicate(timeout=60)
                if p.returncode != 0 or f"joined cluster {cid}" not in said:
                    raise LabError(f"node {i}: lakeshard cluster join failed: {said.strip()[-500:]}")
            self.marks["joined"] = time.monotonic()
            for i in rest:
                self.start(i)
        return cid

    def kill(self, i: int, sig: int = signal.SIGKILL) -> float:
        """Kill node ``i``'s agent; returns the wall time of the kill."""
        p = self.procs[i]
        t = time.time()
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # stuck (e.g. in a compile): the lab must still come down
                p.kill()
                p.wait(timeout=30)
        self.procs[i] = None
        return t

    def alive(self, i: int) -> bool:
        p = self.procs[i]
        return p is not None and p.poll() is None

    # -- probes ----------------------------------------------------------------------------------
    def _probe(self, i: int) -> subprocess.Popen[str]:
        p = self.probes[i]
        if p is None or p.poll() is not None:
            cmd = self.lan.nodes[i].cmd([sys.executable, "-u", "-c", _PROBE])
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.probes[i] = p
        return p

    def ask(self, i: int, q: dict[str, Any]) -> dict[str, Any]:
        p = self._probe(i)
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write(json.dumps(q) + "\n")
        p.stdin.flush()
        out: dict[str, Any] = json.loads(p.stdout.readline())
        return out

    def get(self, i: int, path: str) -> dict[str, Any] | None:
        """GET the node's local status API (None when it does not answer)."""
        r = self.ask(i, {"op": "get", "url": f"http://127.0.0.1:{API_PORT}{path}", "timeout": 2})
        return r["body"] if r.get("ok") else None

    def post(self, i: int, path: str, body: dict[str, Any], timeout: float = 3) -> dict[str, Any] | None:
        q = {"op": "post", "url": f"http://127.0.0.1:{API_PORT}{path}", "body": body, "timeout": timeout}
        r = self.ask(i, q)
        return r["body"] if r.get("ok") else None

    def udp(self, i: int, data: bytes, host: str, port: int = DATA_PORT, wait: float = 1.0) -> bytes | None:
        """Send one datagram from node ``i``'s namespace; the first reply, if any."""
        q = {"op": "udp", "data": base64.b64encode(data).decode(), "host": host, "port": port, "wait": wait}
        r = self.ask(i, q)
        if not r.get("ok"):
            raise RuntimeError(r.get("error"))
        return None if r["reply"] is None else base64.b64decode(r["reply"])

    def clusters(self, nodes: Sequence[int] | None = None) -> dict[int, dict[str, Any] | None]:
        return {i: self.get(i, "/v1/cluster") for i in (range(self.n) if nodes is None else nodes)}

    def wait_for(
        self, pred: Callable[[dict[int, dict[str, Any] | None]], bool], nodes: Sequence[int], timeout: float
    ) -> dict[int, dict[str, Any] | None]:
        """Poll the nodes' /v1/cluster until ``pred`` holds; raises TimeoutError with the last view."""
        deadline = time.monotonic() + timeout
        while True:
            view = self.clusters(nodes)
            if pred(view):
                return view
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not met within {timeout:.0f}s; last view: {summary(view)}")
            time.sleep(0.1)

    def close(self) -> None:
        for i in range(self.n):
            self.kill(i, signal.SIGTERM) if self.alive(i) else None
            p = self.probes[i]
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        self.lan.close()


def agreed(view: dict[int, dict[str, Any] | None], peers_alive: int | None = None) -> str | None:
    """The one coordinator every node in ``view`` follows (each seeing ``peers_alive`` live peers), or None."""
    if any(v is None for v in view.values()):
        return None
    coords = {v["coordinator"] for v in view.values() if v is not None}
    if len(coords) != 1 or None in coords:
        return None
    if peers_alive is not None and any(sum(p["alive"] for p in v["peers"]) != peers_alive for v in view.values() if v):
        return None
    return str(coords.pop())


def summary(view: dict[int, dict[str, Any] | None]) -> str:
    return json.dumps(
        {
            i: None
            if v is None
            else {"node": v["node"], "role": v["role"], "term": v["term"], "coordinator": v["coordinator"]}
            for i, v in view.items()
        }
    )
