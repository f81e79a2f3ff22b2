"""The coordinator's services, as the daemon sees them: what it asks for, what it gets, and where
they come from.

While this node is the elected coordinator, the daemon runs the coordinator's services (plan,
assign, serve the API, publish the event stream). The ``agent`` package never imports the
``coordinator`` package: the services come from a factory that the ``coordinator`` package
declares as the ``lakeshard.coordinator`` entry point (pyproject.toml), typed here by
:class:`Services`. An installation without it runs agents that take part in the election but
cannot serve: the status says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol

from agent.api.events import EventHub
from agent.cluster.offers import Member
from agent.protocol.cluster_view import NodeInfo
from agent.security.transport import Transport

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "lakeshard.coordinator"


@dataclass(frozen=True)
class ServicesSpec:
    """What the daemon asks of the coordinator's services when it wins an election."""

    model: str | None
    weights: str | None
    draft: str | None
    name: str | None  # what node maps call this laptop
    api_port: int
    ring_port: int
    streams: int
    min_nodes: int
    api_rate: int  # requests per minute per client (0: unlimited)
    api_concurrency: int  # requests in flight per client (0: unlimited)
    exact: bool
    term: int
    my_address: str
    cluster: str
    members: Callable[[], list[Member]]  # the nodes heard right now, this one included
    nodes: Callable[[], list[NodeInfo]]  # the same, as node maps show them
    needed_before: Callable[[], tuple[str, ...]]  # the exports the last coordinator needed
    transport: Transport  # how its links to the agents travel (the daemon's)


class Services(Protocol):
    """The coordinator's services while this node coordinates (one term)."""

    term: int
    weights: str | None
    draft: str | None
    hub: EventHub  # the cluster's event stream

    async def async_start(self) -> None: ...  # publish the event stream; plan and serve in the background

    async def async_stop(self) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def needed_exports(self) -> list[str]: ...

    def api_base(self) -> str | None: ...  # the OpenAI-compatible API's base URL, once it serves

    def not_ready(self) -> str | None: ...  # why it cannot answer yet (None once it can)


ServicesFactory = Callable[[ServicesSpec], Services]


class NoCoordinator(RuntimeError):
    """This installation has no coordinator services (the ``coordinator`` package is missing)."""


def load_factory() -> ServicesFactory:
    """The installed coordinator's factory (imports it: torch and OpenVINO, seconds; call it off
    the event loop). Raises :class:`NoCoordinator` when none is installed."""
    found = list(entry_points(group=ENTRY_POINT_GROUP))
    if not found:
        raise NoCoordinator(
            f"no coordinator is installed (no {ENTRY_POINT_GROUP!r} entry point): reinstall lakeshard "
            "(pip install -e . in a source checkout)"
        )
    if len(found) > 1:
        log.warning("several coordinators are installed (%s): using %s", [e.value for e in found], found[0].value)
    factory: ServicesFactory = found[0].load()
    return factory
