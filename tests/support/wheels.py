"""Package folders for pulls without the network: real wheels, served to pip with --find-links."""

from __future__ import annotations

import zipfile
from pathlib import Path


def make_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal, valid pure-Python wheel holding ``files`` under the package directory."""
    pkg = dist.replace("-", "_")
    whl = folder / f"{pkg}-{version}-py3-none-any.whl"
    info = f"{pkg}-{version}.dist-info"
    with zipfile.ZipFile(whl, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr(f"{pkg}/__init__.py", "")
        for name, data in files.items():
            z.writestr(f"{pkg}/{name}", data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return whl
