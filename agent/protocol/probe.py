"""Link probes: a stage measures the round trip to its next hop (shown on node maps).

A stage sends :class:`Ping` on its link to the next stage every second or so; the receiving
agent answers on the same connection with :class:`Pong`, echoing the sender's clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from agent.protocol.codec import Message, float_field, register


@dataclass(frozen=True)
class Ping(Message):
    TYPE: ClassVar[str] = "ping"
    sent: float  # the sender's monotonic clock, seconds

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Ping:
        return Ping(sent=float_field(h.get("sent"), "sent", 0.0, 1e12))


@dataclass(frozen=True)
class Pong(Message):
    TYPE: ClassVar[str] = "pong"
    sent: float  # echoed from the Ping

    @classmethod
    def parse(cls, h: dict[str, Any]) -> Pong:
        return Pong(sent=float_field(h.get("sent"), "sent", 0.0, 1e12))


register(Ping, Pong)
