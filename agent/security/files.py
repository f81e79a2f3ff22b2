"""The security folder (``config_dir()/security``): names, atomic writes with set permissions, a lock.

Keys and the invite store are written 0600 from the moment the file exists (the temporary file
is made 0600, filled, fsynced, then renamed over the old one), so a reader sees the old file or
the new one and never a moment of wider permissions. Public files (certificates, the revocation
list) are 0644. The folder itself is 0700. On Windows the permission bits are whatever the
platform keeps (the folder is the user's own profile).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent.common.paths import config_dir, write_bytes_atomic

CA_KEY = "ca.key"
CA_CERT = "ca.crt"
NODE_KEY = "node.key"
NODE_CERT = "node.crt"
REVOKED = "revoked.json"
INVITES = "invites.json"
MEMBER = "member.json"
LOCK = ".lock"

PRIVATE = 0o600
PUBLIC = 0o644


def security_path(folder: Path | None = None) -> Path:
    """``folder``, or the security folder in the config folder (not made: for readers)."""
    return folder if folder is not None else config_dir() / "security"


def security_dir(folder: Path | None = None) -> Path:
    """:func:`security_path`, made 0700 if it is not there (for writers)."""
    p = security_path(folder)
    if not p.is_dir():
        p.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            p.chmod(0o700)
    return p


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` so readers see the old file or the new one, never half of it, with ``mode``."""
    write_bytes_atomic(path, data, mode)


def write_private(path: Path, data: bytes) -> None:
    write_atomic(path, data, PRIVATE)


def write_public(path: Path, data: bytes) -> None:
    write_atomic(path, data, PUBLIC)


def write_json(path: Path, data: Any, *, private: bool = False) -> None:
    text = json.dumps(data, indent=1, sort_keys=True).encode()
    write_atomic(path, text, PRIVATE if private else PUBLIC)


def read_json(path: Path) -> Any:
    """The JSON in ``path``; None if it is not there. A damaged file raises ValueError."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on the security folder, across processes (the CLI adding an invite while
    the agent spends one): read-modify-write of a file under it is atomic."""
    path = folder / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE)
    try:
        if sys.platform == "win32":
            import msvcrt

            msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
            try:
                yield
            finally:
                os.lseek(fd, 0, os.SEEK_SET)
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
