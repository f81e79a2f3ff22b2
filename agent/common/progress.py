"""Progress for long work (downloads, assembly, hashing, export) on stderr."""

from __future__ import annotations

import sys
import time
from types import TracebackType


class Progress:
    """A byte or step counter that redraws one stderr line at most ~5 times a second."""

    def __init__(self, label: str, total: int | None = None, unit: str = "B", enabled: bool = True) -> None:
        self.label, self.total, self.unit, self.enabled = label, total, unit, enabled
        self.done = 0
        self._last = 0.0
        self._t0 = time.monotonic()

    def _fmt(self, v: float) -> str:
        if self.unit != "B":
            return f"{int(v)}"
        for u in ("B", "KB", "MB", "GB", "TB"):
            if v < 1024 or u == "TB":
                return f"{v:.0f} {u}" if u == "B" else f"{v:.1f} {u}"
            v /= 1024
        return str(v)

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.2 or (self.total and self.done >= self.total)):
            self._last = now
            self._draw()

    def _draw(self, end: str = "") -> None:
        if self.total:
            pct = 100.0 * self.done / self.total
            msg = f"\r{self.label}: {self._fmt(self.done)} / {self._fmt(self.total)} ({pct:5.1f}%)"
        else:
            msg = f"\r{self.label}: {self._fmt(self.done)}"
        sys.stderr.write(msg + end)
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            dt = time.monotonic() - self._t0
            self._draw(end=f" done in {dt:.1f}s\n")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if et is None:
            self.close()
        elif self.enabled:
            sys.stderr.write("\n")


def step(msg: str, enabled: bool = True) -> None:
    """One line announcing a phase of long work."""
    if enabled:
        sys.stderr.write(f"{msg}\n")
        sys.stderr.flush()


class PercentLine:
    """A ``(percent, what)`` reporter (a model pull's) drawn as one stderr line, at most ~5 times a
    second; :meth:`close` ends the line."""

    def __init__(self, label: str, enabled: bool = True) -> None:
        self.label, self.enabled = label, enabled
        self._last = 0.0
        self._drawn = False

    def __call__(self, percent: float | None, what: str) -> None:
        now = time.monotonic()
        if not self.enabled or now - self._last < 0.2:
            return
        self._last = now
        pct = "" if percent is None else f"{percent:5.1f}% "
        sys.stderr.write(f"\r{self.label}: {pct}{what}\033[K")
        sys.stderr.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._drawn = False
