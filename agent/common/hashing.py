"""File hashing shared by the model store, the exporter and artifact delivery."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

CHUNK = 8 << 20


def sha256_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """The file's sha256, read in 8 MiB chunks (``on_bytes`` sees each chunk's size)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while b := f.read(CHUNK):
            h.update(b)
            if on_bytes is not None:
                on_bytes(len(b))
    return h.hexdigest()
