"""Start or attach to this laptop's agent (``lakeshard agent``), and stop it if we started it.

The tray attaches when an agent already answers on the status port (a systemd user unit, a
terminal); otherwise it starts one, its output in the log folder, and reports its first
error line if it exits (a bad setting, a port in use).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from gui.client import Client, Unreachable

log = logging.getLogger(__name__)
STOP_S = 1.5  # an agent leaves within this of SIGTERM (agent.node.shutdown); past it, it is killed


def log_folder() -> Path:
    import platformdirs

    h = os.environ.get("LAKESHARD_HOME")
    d = Path(h).expanduser() / "logs" if h else Path(platformdirs.user_log_dir("lakeshard"))
    d.mkdir(parents=True, exist_ok=True)
    return d


class AgentProcess:
    def __init__(self, client: Client, api_port: int, extra_args: list[str] | None = None) -> None:
        self.client = client
        self.api_port = api_port
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self.output = log_folder() / "agent-console.log"
        self.error: str | None = None
        self._asked: float | None = None  # when it was asked to leave (monotonic)

    @property
    def started_here(self) -> bool:
        return self.proc is not None

    async def async_answers(self) -> bool:
        try:
            await self.client.node()
        except Unreachable:
            return False
        return True

    async def async_ensure(self, timeout: float = 90.0) -> bool:
        """Attach to a running agent, or start one and wait until it answers."""
        self.error = None
        if await self.async_answers():
            return True
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self.async_answers():
                return True
            if self.proc is not None and self.proc.poll() is not None:
                self.error = self.failure()
                return False
            await asyncio.sleep(0.25)
        self.error = f"the agent did not answer within {timeout:.0f} s (see {self.output})"
        return False

    def _start(self) -> None:
        cmd = [sys.executable, "-m", "agent", "agent", "--api-port", str(self.api_port), *self.extra_args]
        log.info("starting the agent: %s", " ".join(cmd))
        flags = getattr(subprocess, "CREATE_NO_WINDOW", 0)
        with open(self.output, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, creationflags=flags
            )

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def failure(self) -> str:
        """Why the agent we started exited: its error line, else its status."""
        code = self.proc.returncode if self.proc is not None else None
        with contextlib.suppress(OSError):
            lines = self.output.read_text(encoding="utf-8", errors="replace").splitlines()[-50:]
            for line in reversed(lines):
                if "error:" in line:
                    return line.split("error:", 1)[1].strip()
        return f"the agent exited with status {code} (see {self.output})"

    def terminate(self) -> None:
        """Ask the agent we started to leave (SIGTERM: it says goodbye and exits within STOP_S)."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        if self._asked is None:
            self._asked = time.monotonic()
        p.terminate()

    def stop(self, timeout: float = STOP_S) -> None:
        """Stop the agent if we started it (one started elsewhere is left running): SIGTERM, then
        killed if it is still there ``timeout`` seconds after it was first asked to leave."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        self.terminate()
        assert self._asked is not None
        try:
            p.wait(timeout=max(0.0, self._asked + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("the agent did not exit within %.1f s of SIGTERM: killed", timeout)
            p.kill()
            p.wait()
