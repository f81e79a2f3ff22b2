"""The chat's colours, taken from the Qt palette (light or dark, as the system's is).

No colour is fixed: each is one of the palette's, a blend of two of them, or a hue (the red of
an error, the amber of a warning) moved until it reads on the palette's background. Every colour
that text is drawn in is checked against the one it is drawn on for WCAG contrast (at least
:data:`MIN_CONTRAST`, the AA level for body text). :func:`from_palette` makes a :class:`Theme`;
:func:`contrast` is the WCAG ratio, for the checks and the tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from PySide6.QtGui import QColor, QPalette

MIN_CONTRAST = 4.5  # WCAG 2 AA for body text
ERROR_HUE = "#dc2626"  # moved until it reads on the background (lighter on a dark one)
WARN_HUE = "#d97706"


def _rgb(c: str) -> tuple[int, int, int]:
    c = c.lstrip("#")
    return int(c[0:2], 16), int(c[2:4], 16), int(c[4:6], 16)


def _hex(r: float, g: float, b: float) -> str:
    return "#{:02x}{:02x}{:02x}".format(*(max(0, min(255, round(v))) for v in (r, g, b)))


def luminance(c: str) -> float:
    """WCAG relative luminance of ``#rrggbb`` (0 black .. 1 white)."""

    def lin(v: int) -> float:
        s = v / 255
        return s / 12.92 if s <= 0.04045 else ((s + 0.055) / 1.055) ** 2.4

    r, g, b = _rgb(c)
    return 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b)


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two ``#rrggbb`` colours (1 .. 21)."""
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def blend(a: str, b: str, t: float) -> str:
    """``a`` moved ``t`` (0 .. 1) of the way to ``b``."""
    (r1, g1, b1), (r2, g2, b2) = _rgb(a), _rgb(b)
    return _hex(r1 + (r2 - r1) * t, g1 + (g2 - g1) * t, b1 + (b2 - b1) * t)


@functools.lru_cache(maxsize=1024)
def readable(fg: str, bg: str, ratio: float = MIN_CONTRAST) -> str:
    """``fg``, or the nearest blend of it towards black or white (whichever reads better on
    ``bg``) that has at least ``ratio`` contrast with ``bg``."""
    if contrast(fg, bg) >= ratio:
        return fg
    far = "#000000" if contrast("#000000", bg) >= contrast("#ffffff", bg) else "#ffffff"
    for i in range(1, 21):
        c = blend(fg, far, i / 20)
        if contrast(c, bg) >= ratio:
            return c
    return far


@dataclass(frozen=True)
class Theme:
    """The colours the chat draws with (``#rrggbb``), all from one palette."""

    text: str  # body text, on ``base``
    base: str  # the transcript's background
    muted: str  # small print (an answer's figures), on ``base``
    link: str  # links in the transcript, on ``base`` and on ``code_head_bg``
    user_bg: str  # behind the user's messages (``text`` on it)
    code_bg: str  # behind a code block (``text`` and the highlighted tokens on it)
    code_head_bg: str  # the code block's head (its language and Copy)
    error: str  # what went wrong with an answer, on ``base``
    window_muted: str  # the status line, on the window's background
    info_bg: str  # the banners' backgrounds (``text`` on them)
    warn_bg: str
    error_bg: str
    dark: bool  # light text on a dark background
    code_style: str  # the Pygments style the code's colours start from

    def banner_style(self, kind: str) -> str:
        """The banner's style sheet for ``kind`` (info, warn or error)."""
        bg = {"warn": self.warn_bg, "error": self.error_bg}.get(kind, self.info_bg)
        return f"background:{bg};color:{self.text};padding:6px;border-radius:4px"


def from_colours(
    text: str, base: str, link: str, highlight: str, window_text: str | None = None, window: str | None = None
) -> Theme:
    """The theme for a palette given by its colours (``#rrggbb``); see :func:`from_palette`."""
    dark = luminance(base) < luminance(text)
    text = readable(text, base)
    window_text, window = window_text or text, window or base

    def behind(tint: str, t: float) -> str:  # a background tinted towards ``tint`` that ``text`` reads on
        while t > 0 and contrast(text, blend(base, tint, t)) < MIN_CONTRAST:
            t -= 0.02
        return blend(base, tint, max(t, 0.0))

    code_head_bg = behind(text, 0.10)
    return Theme(
        text=text,
        base=base,
        muted=readable(blend(text, base, 0.4), base),
        link=readable(readable(link, base), code_head_bg),
        user_bg=behind(highlight, 0.14 if dark else 0.12),
        code_bg=behind(text, 0.05),
        code_head_bg=code_head_bg,
        error=readable(ERROR_HUE, base),
        window_muted=readable(blend(window_text, window, 0.4), window),
        info_bg=behind(highlight, 0.18),
        warn_bg=behind(WARN_HUE, 0.22),
        error_bg=behind(ERROR_HUE, 0.2),
        dark=dark,
        code_style="github-dark" if dark else "default",
    )


def from_palette(p: QPalette) -> Theme:
    """The theme for palette ``p`` (a widget's, which follows the system's)."""

    def c(role: QPalette.ColorRole) -> str:
        col: QColor = p.color(QPalette.ColorGroup.Active, role)
        return str(col.name())

    R = QPalette.ColorRole
    return from_colours(c(R.Text), c(R.Base), c(R.Link), c(R.Highlight), c(R.WindowText), c(R.Window))
