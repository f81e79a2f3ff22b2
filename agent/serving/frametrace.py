"""Per-frame timestamps, to see where a pipeline step's time goes between the stages.

A developer's tool, off unless ``LAKESHARD_FRAME_TRACE`` names a folder. Each agent process
then appends one line per event to ``frames-<pid>.log`` there::

    <CLOCK_MONOTONIC ns> <event> <stream> <seq>

CLOCK_MONOTONIC is one clock for every process of a machine, so the lines of a local
cluster's agents (``lakeshard bench pipeline`` passes the variable on) line up. Events:
``recv`` (a Fwd frame decoded on the event loop), ``start`` and ``end`` (its step on the
compute thread), ``done`` (the result back on the event loop) and ``sent`` (a frame written to
a next-hop websocket; stream ``-``, seq = its size). A step whose vocabulary head is split
(the last stage, a lone stream) adds ``trunk`` (its layers done), ``head_sent`` (the request on
its way to stage 0) and ``head_top`` (stage 0's answer back); stage 0 logs ``head_recv`` and
``head_done`` (its part computed, on the event loop). ``docs/bench/hop_trace.py`` turns a run's
files into a per-hop breakdown. A line costs one ``write`` (a few microseconds).
"""

from __future__ import annotations

import os
import time

ENV = "LAKESHARD_FRAME_TRACE"
_dir = os.environ.get(ENV) or None
_fd: int | None = None


def enabled() -> bool:
    return _dir is not None


def mark(event: str, stream: str = "-", seq: int = 0) -> None:
    global _fd
    if _dir is None:
        return
    if _fd is None:
        os.makedirs(_dir, exist_ok=True)
        _fd = os.open(os.path.join(_dir, f"frames-{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(_fd, f"{time.monotonic_ns()} {event} {stream} {seq}\n".encode())
