"""Figures worth seeing after a test run (printed in the terminal summary by conftest)."""

from __future__ import annotations

LINES: list[str] = []


def report(line: str) -> None:
    LINES.append(line)
