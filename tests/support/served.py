"""A real cluster served by ``lakeshard serve`` (agent processes plus the coordinator process), and
chatting through a coordinator's OpenAI-compatible API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from typing import Any

from tests.support.cli import REPO


class Served:
    """A real cluster: agent processes plus a ``lakeshard serve`` coordinator process."""

    def __init__(
        self,
        n: int,
        *extra: str,
        agent_env: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        agent_args: list[str] | None = None,
        agent_envs: list[dict[str, str]] | None = None,
        ports: list[int] | None = None,
        secure: bool = False,
    ) -> None:
        """``agent_envs``: one environment per agent over ``agent_env`` (e.g. its own LAKESHARD_HOME);
        ``ports``: the agents' data ports (default: free ones); ``secure``: TLS between the nodes,
        with the credentials in each process's home (default: plaintext, ``--insecure``)."""
        from coordinator.lab.local_cluster import LocalCluster, free_port

        self.cluster = LocalCluster(
            n, env=agent_env, agent_args=agent_args or (), agent_envs=agent_envs, ports=ports, secure=secure
        ).start()
        self.api_port = free_port()
        self.api_url = f"http://127.0.0.1:{self.api_port}"
        cmd = [sys.executable, "-m", "agent", "serve", "--nodes", ",".join(self.cluster.nodes)]
        cmd += ["--api-port", str(self.api_port), *extra, *(() if secure else ("--insecure",))]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
            cwd=REPO,
        )
        self.output: list[str] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("lakeshard: serving"):
                break
        else:
            self.stop()
            raise RuntimeError("coordinator did not start:\n" + "".join(self.output[-30:]))
        # keep draining its output so it can never block on a full pipe
        self.drained = threading.Thread(target=lambda: self.output.extend(self.proc.stdout or []), daemon=True)
        self.drained.start()

    @property
    def nodes(self) -> list[str]:
        return self.cluster.nodes

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.cluster.stop()


def post_chat(url: str, body: dict[str, Any], timeout: float = 300) -> tuple[int, dict[str, Any]]:
    """POST a chat completion to the coordinator API at ``url``: the status and the JSON body."""
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(served: Served, prompt: str, **kw: Any) -> str:
    """One user message through ``served``'s API; the reply's text (the request must succeed)."""
    status, body = post_chat(served.api_url, {"messages": [{"role": "user", "content": prompt}], **kw})
    assert status == 200, body
    return str(body["choices"][0]["message"]["content"])
