"""Agent processes on this machine: the stand-in for laptops in tests, benchmarks and ``make run``.

Each agent is a separate process (``lakeshard agent``), optionally pinned to its own cores
before OpenVINO is imported (its CPU plugin pins threads from the affinity it starts with).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from agent.common import paths


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalCluster:
    def __init__(
        self,
        n: int,
        *,
        cores: Sequence[Sequence[int]] | None = None,
        threads: int | None = None,
        device: str | None = None,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        elect: Sequence[str] | None = None,
        agent_args: Sequence[str] = (),
        names: Sequence[str] | None = None,
        throttle: bool = False,
        agent_envs: Sequence[dict[str, str]] | None = None,
        config: str | Sequence[str] | None = None,
        ports: Sequence[int] | None = None,
        secure: bool = False,
        form: bool = False,
        capacity: Path | None = None,
        attention: str | None = None,
    ) -> None:
        """``elect``: run full agents (election, no multicast, loopback peers) with these extra
        arguments, instead of standalone stage servers driven by a ``serve`` coordinator.
        ``agent_args``: more ``lakeshard agent`` arguments for every agent (e.g. ``--spin-ms 0``).
        ``ports``: the agents' data ports (default: free ones).
        ``secure``: each agent uses the cluster credentials in its home (TLS between nodes); by
        default local clusters are plaintext (``--insecure``), like the in-process coordinators
        of tests and benchmarks, whatever credentials the user's own home holds.
        ``form`` (secure elected agents): make a throwaway cluster the way the tray does, through
        the agents' local APIs: ``init`` on the first, ``invite`` there, ``join`` on the others.
        ``capacity`` (elected agents): a ``capacity.json`` copied into every home before its agent
        starts: identical laptops (one plan, so one cached export; no speed test on loaded cores).
        ``attention``: how every agent's stage attends (``auto``, ``paged`` or ``stateful``; None:
        as the agents' own default, ``LAKESHARD_ATTENTION`` included)."""
        if attention not in (None, "auto", "paged", "stateful"):
            raise ValueError(f"attention must be auto, paged or stateful, not {attention!r}")
        self.attention = attention
        self.capacity = capacity
        if ports is not None and len(ports) != n:
            raise ValueError("one port per agent")
        self._fixed_ports = list(ports) if ports is not None else None
        self.secure = secure
        if form and (not secure or elect is None):
            raise ValueError("form: only for secure, elected agents")
        self.form = form
        self.cluster_id: str | None = None
        if cores is not None and len(cores) != n:
            raise ValueError("one core set per agent")
        self.n = n
        self.cores = cores
        self.threads = threads
        self.device = device
        self.env = env or {}
        self.log_dir = log_dir
        self.ports: list[int] = []
        self.api_ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self._spawn: list[tuple[list[str], dict[str, str], Path | None]] = []  # each agent's command, env, log
        self.elect = elect
        self.agent_args = list(agent_args)
        self.names = list(names) if names is not None else None  # what node maps call each agent
        # agents on one machine would each count the others as their user's programs: off by default
        self.throttle = throttle
        self.agent_envs = list(agent_envs) if agent_envs is not None else None  # per agent, over ``env``
        # config.yaml text for every elected agent's own home (one text for all, or one each)
        self.configs = [config] * n if config is None or isinstance(config, str) else list(config)
        self._homes: tempfile.TemporaryDirectory[str] | None = None

    @property
    def nodes(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def home(self, i: int) -> Path:
        """Elected agent ``i``'s LAKESHARD_HOME (its security folder: ``home(i) / "config" / "security"``)."""
        if self._homes is None:
            raise RuntimeError("only elected agents have homes of their own, once started")
        own = (self.agent_envs[i] if self.agent_envs is not None else {}).get("LAKESHARD_HOME")
        return Path(own) if own else Path(self._homes.name) / f"agent{i}"

    def start(self, timeout: float = 60.0) -> LocalCluster:
        ports = self._fixed_ports or [free_port() for _ in range(self.n)]
        self.api_ports = [free_port() for _ in range(self.n)] if self.elect is not None else []
        for i in range(self.n):
            port = ports[i]
            cmd = [sys.executable, "-m", "agent", "agent", "--host", "127.0.0.1", "--port", str(port)]
            if self.elect is None:
                cmd += ["--standalone", "--api-port", "0"]
            else:
                peers = ",".join(f"127.0.0.1:{p}" for p in ports)
                cmd += ["--api-port", str(self.api_ports[i]), "--no-mdns", "--interface", "127.0.0.1"]
                cmd += ["--static-peers", peers, *self.elect]
                if "--serve-ring-port" not in self.elect:  # port + 2 may be another agent's here
                    cmd += ["--serve-ring-port", "0"]
            threads = self.threads or (len(self.cores[i]) if self.cores else None)
            if threads:
                cmd += ["--threads", str(threads)]
            if self.device:  # one device for all, or a comma list cycled over the nodes: GPU,CPU
                devs = [d.strip() for d in self.device.split(",") if d.strip()]
                cmd += ["--device", devs[i % len(devs)]]
            if not self.throttle:
                cmd += ["--throttle", "off"]
            if self.attention is not None:
                cmd += ["--attention", self.attention]
            if not self.secure:
                cmd.append("--insecure")
            cmd += self.agent_args
            if self.names is not None:
                cmd += ["--name", self.names[i]]
            if self.cores is not None:
                cmd = ["taskset", "-c", ",".join(map(str, self.cores[i])), *cmd]
            log = self.log_dir / f"agent{i}.log" if self.log_dir else None
            out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
            env = {**os.environ, "PYTHONWARNINGS": "ignore", **self.env}
            if self.elect is not None:
                # each agent its own identity and term (like separate laptops); models and exports shared
                if self._homes is None:
                    self._homes = tempfile.TemporaryDirectory(prefix="lakeshard-agents-")
                env["LAKESHARD_SHARED_CACHE"] = env.get("LAKESHARD_SHARED_CACHE") or str(paths.cache_dir())
                own = (self.agent_envs[i] if self.agent_envs is not None else {}).get("LAKESHARD_HOME")
                env["LAKESHARD_HOME"] = own or str(Path(self._homes.name) / f"agent{i}")
                seeded = Path(env["LAKESHARD_HOME"]) / "cache" / "capacity.json"
                if self.capacity is not None and not seeded.exists():
                    seeded.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(self.capacity, seeded)
                if self.configs[i] is not None:
                    cfg = Path(env["LAKESHARD_HOME"]) / "config" / "config.yaml"
                    cfg.parent.mkdir(parents=True, exist_ok=True)
                    cfg.write_text(str(self.configs[i]), encoding="utf-8")
            if self.agent_envs is not None:
                env.update(self.agent_envs[i])
            self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
            self._spawn.append((cmd, env, log))
            self.ports.append(port)
        deadline = time.monotonic() + timeout
        if self.form:
            try:
                self.cluster_id = self._form(deadline)
            except (OSError, RuntimeError) as e:
                self.stop()
                raise RuntimeError(f"could not form the cluster: {e}") from None
        for port, proc in zip(self.ports, self.procs, strict=True):
            while True:
                if proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"agent on port {port} exited with status {proc.returncode}")
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                if time.monotonic() > deadline:
                    self.stop()
                    why = " (secure: without credentials in its home it waits for a cluster)" if self.secure else ""
                    raise RuntimeError(f"agent on port {port} did not start within {timeout:.0f}s{why}")
                time.sleep(0.1)
        return self

    def _local(self, i: int, path: str, body: dict[str, Any] | None, deadline: float) -> dict[str, Any]:
        """POST ``body`` (or GET) to agent ``i``'s local API, retrying until it answers."""
        url = f"http://127.0.0.1:{self.api_ports[i]}{path}"
        while True:
            if self.procs[i].poll() is not None:
                raise RuntimeError(f"agent {i} exited with status {self.procs[i].returncode}")
            data = json.dumps(body).encode() if body is not None else None
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return dict(json.loads(r.read()))
            except urllib.error.HTTPError as e:
                raise RuntimeError(f"agent {i}: {path}: {e.read().decode(errors='replace')[:300]}") from None
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"agent {i}'s local API did not answer") from None
                time.sleep(0.2)

    def _form(self, deadline: float) -> str:
        first = self._check(0, self._local(0, "/v1/cluster/init", {}, deadline))
        if self.n > 1:
            addr = f"127.0.0.1:{self.ports[0]}"
            ask = {"uses": str(self.n - 1), "expires": "1h", "address": addr}
            inv = self._local(0, "/v1/cluster/invite", ask, deadline)
            while not self._port_open(self.ports[0]):  # the first agent starts serving its join route
                if time.monotonic() > deadline:
                    raise RuntimeError("the first agent did not start as a member")
                time.sleep(0.1)
            for i in range(1, self.n):
                self._check(i, self._local(i, "/v1/cluster/join", {"token": inv["token"]}, deadline))
        return str(first.get("cluster_id") or "")

    @staticmethod
    def _check(i: int, answer: dict[str, Any]) -> dict[str, Any]:
        if answer.get("agent_error"):
            raise RuntimeError(f"agent {i} did not start as a member: {answer['agent_error']}")
        return answer

    @staticmethod
    def _port_open(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def kill(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].wait()

    def restart(self, i: int, timeout: float = 60.0) -> None:
        """Start agent ``i`` again after :meth:`kill`: same command, home and ports (a laptop back)."""
        cmd, env, log = self._spawn[i]
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        self.procs[i] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while not self._port_open(self.ports[i]):
            if self.procs[i].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent {i} did not start again")
            time.sleep(0.1)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._homes is not None:
            self._homes.cleanup()
            self._homes = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
