"""`lakeshard agent` processes in homes of their own, as a user starts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from coordinator.lab.local_cluster import free_port
from tests.support.cli import REPO


class Agent:
    """``lakeshard agent`` in its own home, without --insecure; its output kept line by line."""

    def __init__(self, home: Path, *extra: str, port: int | None = None, config: str = "") -> None:
        self.home, self.port, self.api = home, port or free_port(), free_port()
        (home / "config").mkdir(parents=True)
        # the CLI names the node of the settings' port: the one this agent serves
        (home / "config" / "config.yaml").write_text(f"port: {self.port}\n{config}", encoding="utf-8")
        self.env = {"LAKESHARD_HOME": str(home)}
        cmd = [sys.executable, "-m", "agent", "agent", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--api-port", str(self.api), "--device", "CPU", "--throttle", "off", "--interface", "127.0.0.1"]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", **self.env}
        self.proc = subprocess.Popen(
            [*cmd, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
        )
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout or []), daemon=True).start()

    @property
    def security(self) -> Path:
        return self.home / "config" / "security"

    def get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.api}{path}", timeout=10) as r:
            d: dict[str, Any] = json.loads(r.read())
            return d

    def post(
        self, path: str, body: dict[str, Any], timeout: float = 30, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.api}{path}",
            json.dumps(body).encode(),
            {"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def answers(self) -> bool:
        assert self.proc.poll() is None, "".join(self.lines[-20:])
        try:
            self.get("/v1/node")
        except OSError:
            return False
        return True

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
