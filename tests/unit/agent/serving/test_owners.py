"""Stream ownership of micro-batch parts that fork another stream (prefix caching)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from agent.protocol import Part, ProtocolError
from agent.serving.owners import Owners


@dataclass
class Conn:
    closed: bool = False


def test_a_part_forks_only_a_stream_its_own_connection_owns() -> None:
    """A fork reads its source's KV: naming another connection's stream, or one not held here,
    is refused with an error naming the forking part's stream, and claims nothing."""
    owners, mine, theirs = Owners(), Conn(), Conn()
    owners.admit_part(Part("a", 0, 4, start=True), mine, False)
    owners.admit_part(Part("x", 0, 4, start=True), theirs, False)
    owners.admit_part(Part("b", 0, 2, start=True, fork="a", fork_len=32), mine, False)
    assert owners.owner("b") is mine
    for source, code in (("x", "not_owner"), ("ghost", "unknown_stream")):
        with pytest.raises(ProtocolError) as e:
            owners.admit_part(Part("c", 0, 2, start=True, fork=source, fork_len=32), mine, False)
        assert (e.value.code, e.value.stream) == (code, "c") and repr(source) in str(e.value)
        assert owners.owner("c") is None
