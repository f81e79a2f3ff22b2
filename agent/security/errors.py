"""The errors of :mod:`agent.security`: each one a single line a user can act on."""

from __future__ import annotations


class SecurityError(Exception):
    """A credential, token or list that cannot be used (the message says why, in one line)."""


class JoinError(SecurityError):
    """Joining a cluster failed: the member is unreachable, or it (or the token) was refused."""
