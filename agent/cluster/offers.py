"""What the members offer the coordinator's planner, as the daemon reads it from their beats."""

from __future__ import annotations

from dataclasses import dataclass

from agent.protocol import StageReport


@dataclass(frozen=True)
class NodeOffer:
    """What one device of a node offers the planner: free memory, measured speed and throttle state.

    A node offers one per device (its CPU, its GPU); an agent that does not say per device
    (an older one) offers one for the whole node, with ``device`` empty.
    """

    node: str
    mem_free: int
    speed: float  # GFLOP/s from the capacity probe
    state: str = "available"  # limited: counted at half speed; paused: not used
    device: str = ""  # the OpenVINO device (CPU, GPU, GPU.1); "": the agent's own choice


@dataclass(frozen=True)
class Member:
    """A node the coordinator may plan over, one per device it offers."""

    offer: NodeOffer
    address: str  # host:port of its stage server
    measured: bool = True  # its speed comes from its capacity probe (not a placeholder)
    serving: StageReport | None = None  # the stage it runs now (its beats say)
    holds: tuple[str, ...] = ()  # the exports it holds whole
