"""Render the icons: every SVG in assets/icons to PNGs (16-256 px), and the application icon
(lakeshard.svg) to a Windows .ico and a macOS .icns as well.

    python assets/build_icons.py [--out DIR]     (default: assets/icons)

The SVGs are the sources (one per tray state, plus the application icon); what this writes
is derived, and committed so that installers need no Qt to build.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES = (16, 20, 24, 32, 40, 48, 64, 128, 256)
ICO_SIZES = (16, 20, 24, 32, 40, 48, 64, 128, 256)
# icns element types holding PNG data, by pixel size
ICNS_TYPES = {16: b"icp4", 32: b"icp5", 64: b"icp6", 128: b"ic07", 256: b"ic08", 512: b"ic09"}


def render_png(svg: Path, size: int) -> bytes:
    """``svg`` rendered to a square PNG of ``size`` pixels (transparent background)."""
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    if QGuiApplication.instance() is None:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
        QGuiApplication(sys.argv[:1])
    r = QSvgRenderer(str(svg))
    if not r.isValid():
        raise ValueError(f"{svg} is not a valid SVG")
    img = QImage(size, size, QImage.Format.Format_ARGB32)
    img.fill(0)
    p = QPainter(img)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    r.render(p)
    p.end()
    ba = QByteArray()
    buf = QBuffer(ba)
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    img.save(buf, "PNG")
    return bytes(ba.data())


def ico_bytes(pngs: dict[int, bytes]) -> bytes:
    """A Windows .ico holding the PNGs (PNG-compressed entries, Vista and later)."""
    sizes = sorted(pngs)
    out = struct.pack("<HHH", 0, 1, len(sizes))
    offset = 6 + 16 * len(sizes)
    data = b""
    for s in sizes:
        png = pngs[s]
        dim = 0 if s >= 256 else s
        out += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(png), offset + len(data))
        data += png
    return out + data


def icns_bytes(pngs: dict[int, bytes]) -> bytes:
    """A macOS .icns holding the PNGs of the sizes it has element types for."""
    body = b""
    for s in sorted(pngs):
        kind = ICNS_TYPES.get(s)
        if kind is not None:
            body += kind + struct.pack(">I", 8 + len(pngs[s])) + pngs[s]
    return b"icns" + struct.pack(">I", 8 + len(body)) + body


def build(src: Path = HERE / "icons", out: Path | None = None) -> list[Path]:
    out = out or src
    (out / "png").mkdir(parents=True, exist_ok=True)
    written = []
    for svg in sorted(src.glob("*.svg")):
        pngs = {s: render_png(svg, s) for s in SIZES}
        for s, png in pngs.items():
            p = out / "png" / f"{svg.stem}-{s}.png"
            p.write_bytes(png)
            written.append(p)
        if svg.stem == "lakeshard":
            pngs[512] = render_png(svg, 512)
            ico = out / "lakeshard.ico"
            ico.write_bytes(ico_bytes({s: pngs[s] for s in ICO_SIZES}))
            icns = out / "lakeshard.icns"
            icns.write_bytes(icns_bytes(pngs))
            written += [ico, icns]
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="where to write (default: next to the SVGs)")
    args = ap.parse_args()
    files = build(out=args.out)
    print(f"wrote {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
