"""The Qt binding the tray runs on must not leak references to None.

PySide6-Essentials 6.12.0 on Python 3.11 drops a reference to None on every Qt call that returns
nothing; None is not immortal before Python 3.12, so after some minutes of node-map repaints the
tray aborted ("Fatal Python error: none_dealloc: deallocating None"), found in a walkthrough.
constraints.txt pins a release without that bug; this keeps a future pin honest.
"""

from __future__ import annotations

import sys

import pytest

QtCore = pytest.importorskip("PySide6.QtCore")


def test_qt_calls_that_return_nothing_leave_none_alone() -> None:
    o = QtCore.QObject()
    before = sys.getrefcount(None)
    for _ in range(1000):
        o.setObjectName("lakeshard")
    # a little slack for the interpreter's own use of None between the two counts
    assert abs(sys.getrefcount(None) - before) < 50
