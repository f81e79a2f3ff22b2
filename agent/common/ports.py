"""Listening on a port: whether it can be bound as the servers bind it, and the error when it
cannot, whose message is the whole story (which port, why, and the flag that fixes it): the
command line prints it as one line, never a traceback."""

from __future__ import annotations

import errno
import os
import socket


class ListenError(OSError):
    """A port this process must listen on cannot be bound (taken, or an address not here)."""


def listen_error(what: str, host: str, port: int, e: OSError, fix: str) -> ListenError:
    """``what`` (the API, the data port...) cannot listen on ``host:port`` because of ``e``; ``fix``
    says what to do."""
    return ListenError(f"{what} cannot listen on {host}:{port} ({e.strerror or e}); {fix}")


def port_taken(e: OSError) -> bool:
    """Whether ``e`` says another socket holds the port (not, say, an address not on this machine)."""
    return e.errno in (errno.EADDRINUSE, getattr(errno, "WSAEADDRINUSE", errno.EADDRINUSE))


def bind_error(host: str, port: int, kind: int = socket.SOCK_STREAM) -> OSError | None:
    """Why ``port`` cannot be bound on ``host`` (None: it can), as aiohttp's listener binds it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, kind) as s:
        if kind == socket.SOCK_STREAM and os.name != "nt":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's listener does
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None
