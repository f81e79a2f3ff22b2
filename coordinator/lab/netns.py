"""A virtual office LAN made of Linux network namespaces (root only), for tests and benchmarks.

Each node gets its own namespace with one interface (``eth0``) on one of two bridges; the
bridges are joined by a trunk link, so bringing the trunk down splits the LAN into two
halves (a partition) and bringing it up heals it. Multicast (mDNS) crosses the bridges like
a real switch. Everything is removed on :meth:`Lan.close`, also after a failure, and
namespaces left behind by a crashed run (its process gone) are removed by the next one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

PREFIX = "lsh"
SUBNET = "10.77.0"


class LanError(RuntimeError):
    pass


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is missing"
    return None


def _ip(*args: str, check: bool = True) -> str:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise LanError(f"ip {' '.join(args)}: {p.stderr.strip()}")
    return p.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Remove namespaces and bridges of earlier runs whose process has exited."""
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX) or "n" not in name[len(PREFIX) :]:
            continue
        pid = name[len(PREFIX) :].split("n")[0]
        if pid.isdigit() and not _alive(int(pid)):
            _kill_ns(name)
            _ip("netns", "delete", name, check=False)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).splitlines():
        dev = line.split(":")[1].strip().split("@")[0]
        if dev.startswith("lsb") and dev[3:-1].isdigit() and not _alive(int(dev[3:-1])):
            _ip("link", "delete", dev, check=False)


def _kill_ns(ns: str) -> None:
    for pid in _ip("netns", "pids", ns, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)


@dataclass(frozen=True)
class Node:
    index: int
    ns: str
    ip: str
    veth: str  # the host-side end, on a bridge

    def cmd(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]


class Lan:
    """``n`` namespaces; the first ``split`` nodes on bridge A, the rest on bridge B."""

    def __init__(self, n: int, split: int | None = None) -> None:
        why = available()
        if why:
            raise LanError(why)
        self.n = n
        self.split = n // 2 if split is None else split
        pid = os.getpid()
        self.bridges = (f"lsb{pid}a", f"lsb{pid}b")
        self.trunk = (f"lst{pid}a", f"lst{pid}b")
        self.nodes = [Node(i, f"{PREFIX}{pid}n{i}", f"{SUBNET}.{i + 1}", f"lsv{pid}n{i}") for i in range(n)]
        if any(len(x) > 15 for x in (*self.bridges, *self.trunk, *(nd.veth for nd in self.nodes))):
            raise LanError("interface names too long for this process id")

    def start(self) -> Lan:
        remove_stale()
        try:
            for br in self.bridges:
                _ip("link", "add", br, "type", "bridge")
                _ip("link", "set", br, "type", "bridge", "mcast_snooping", "0")
                _ip("link", "set", br, "up")
            a, b = self.trunk
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", a, "master", self.bridges[0], "up")
            _ip("link", "set", b, "master", self.bridges[1], "up")
            for nd in self.nodes:
                _ip("netns", "add", nd.ns)
                _ip("link", "add", nd.veth, "type", "veth", "peer", "name", "eth0", "netns", nd.ns)
                br = self.bridges[0] if nd.index < self.split else self.bridges[1]
                _ip("link", "set", nd.veth, "master", br, "up")
                _ip("-n", nd.ns, "addr", "add", f"{nd.ip}/24", "dev", "eth0")
                _ip("-n", nd.ns, "link", "set", "eth0", "multicast", "on", "up")
                _ip("-n", nd.ns, "link", "set", "lo", "up")
                _ip("-n", nd.ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
        except BaseException:
            self.close()
            raise
        return self

    # -- faults --------------------------------------------------------------------------------
    def partition(self) -> None:
        """Cut the trunk: nodes on bridge A no longer reach nodes on bridge B."""
        _ip("link", "set", self.trunk[0], "down")

    def heal(self) -> None:
        _ip("link", "set", self.trunk[0], "up")

    def isolate(self, i: int, down: bool = True) -> None:
        """Unplug (or plug back) one node's cable."""
        _ip("link", "set", self.nodes[i].veth, "down" if down else "up")

    def close(self) -> None:
        for nd in self.nodes:
            _kill_ns(nd.ns)
            _ip("netns", "delete", nd.ns, check=False)
            _ip("link", "delete", nd.veth, check=False)
        _ip("link", "delete", self.trunk[0], check=False)
        for br in self.bridges:
            _ip("link", "delete", br, check=False)

    def __enter__(self) -> Lan:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
