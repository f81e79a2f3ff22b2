"""The cluster event stream: what the coordinator tells node maps, trays and ``status --watch``.

One websocket (``/v1/cluster/events``) carries JSON text messages, each an object with a
``type``: first a :class:`Snapshot` of the whole cluster, then what changed, as it happens
(nodes joining, leaving or changing state, the plan moving, failovers, streams starting and
finishing). A subscriber that falls behind gets a fresh snapshot instead of a backlog.

These types are shared by the coordinator (which publishes them) and the GUI (which reads
them): typed, frozen, every field checked on receipt (:func:`parse_event`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from agent.protocol.cluster_view import (
    MAX_EVENT_BYTES,
    MAX_NODES,
    OUTCOMES,
    SERVICES,
    ClusterView,
    NodeInfo,
    Preparation,
    ids_field,
    layers_field,
    opt_float,
    opt_preparation,
)
from agent.protocol.codec import ProtocolError, float_field, int_field, opt_str_field, str_field
from agent.protocol.control import choice_field, id_field, opt_id_field


@dataclass(frozen=True)
class Event:
    TYPE: ClassVar[str] = ""
    at: float  # wall clock, seconds

    def to_json(self) -> str:
        return json.dumps({"type": self.TYPE, **asdict(self)})

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Event:
        raise NotImplementedError


def _at(d: dict[str, Any]) -> float:
    return float_field(d.get("at"), "at", 0.0, 1e11)


@dataclass(frozen=True)
class Snapshot(Event):
    """Everything, at once: the first message on a connection, and after falling behind."""

    TYPE: ClassVar[str] = "snapshot"
    view: ClusterView = field(default_factory=lambda: ClusterView("default", None, 0))

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Snapshot:
        return Snapshot(_at(d), ClusterView.parse(d.get("view")))


@dataclass(frozen=True)
class NodeJoined(Event):
    TYPE: ClassVar[str] = "node_joined"
    node: NodeInfo = field(default_factory=lambda: NodeInfo("x", "x", "x", "follower", "available"))

    @classmethod
    def parse(cls, d: dict[str, Any]) -> NodeJoined:
        return NodeJoined(_at(d), NodeInfo.parse(d.get("node")))


@dataclass(frozen=True)
class NodeChanged(Event):
    """A node's state, role, stage or figures moved; ``changed`` names the fields."""

    TYPE: ClassVar[str] = "node_changed"
    node: NodeInfo = field(default_factory=lambda: NodeInfo("x", "x", "x", "follower", "available"))
    changed: tuple[str, ...] = ()

    @classmethod
    def parse(cls, d: dict[str, Any]) -> NodeChanged:
        ch = d.get("changed", [])
        if not isinstance(ch, list | tuple) or len(ch) > 32 or not all(isinstance(c, str) and len(c) < 32 for c in ch):
            raise ProtocolError("bad_field", "changed must be a list of field names")
        return NodeChanged(_at(d), NodeInfo.parse(d.get("node")), tuple(ch))


@dataclass(frozen=True)
class NodeLeft(Event):
    """A node stopped beating (died, unplugged, shut down)."""

    TYPE: ClassVar[str] = "node_left"
    node: str = ""
    name: str = ""

    @classmethod
    def parse(cls, d: dict[str, Any]) -> NodeLeft:
        return NodeLeft(_at(d), id_field(d.get("node"), "node"), str(d.get("name", ""))[:128])


@dataclass(frozen=True)
class PlanChanged(Event):
    """The pipeline moved: a new ring (node ids in stage order) with each stage's layers."""

    TYPE: ClassVar[str] = "plan_changed"
    ring: tuple[str, ...] = ()
    layers: tuple[tuple[int, int], ...] = ()
    model: str | None = None
    service: str = "idle"
    term: int = 0

    @classmethod
    def parse(cls, d: dict[str, Any]) -> PlanChanged:
        ring = ids_field(d.get("ring", []), "ring")
        raw = d.get("layers", [])
        if not isinstance(raw, list | tuple) or len(raw) != len(ring):
            raise ProtocolError("bad_field", "layers must give one [first, end] per ring node")
        layers = tuple(layers_field(x, "layers") or (0, 1) for x in raw)
        return PlanChanged(
            _at(d),
            ring,
            layers,
            opt_str_field(d.get("model"), "model", 300),
            choice_field(d.get("service", "idle"), "service", SERVICES),
            int_field(d.get("term", 0), "term"),
        )


@dataclass(frozen=True)
class Failover(Event):
    """A stage's node was lost mid-service; streams moved to the survivors."""

    TYPE: ClassVar[str] = "failover"
    lost: str = ""  # the lost node (id, or address where the id is unknown)
    seconds: float = 0.0  # how long the streams paused
    term: int = 0

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Failover:
        return Failover(
            _at(d),
            str_field(d.get("lost"), "lost", 300),
            float_field(d.get("seconds", 0.0), "seconds", 0.0, 1e6),
            int_field(d.get("term", 0), "term"),
        )


@dataclass(frozen=True)
class Takeover(Event):
    """A newly elected coordinator adopted the plan that was running: ``kept`` stages stayed where
    they ran (compiled), ``moved`` lost ones went to nodes that held them; ``exported`` says whether
    anything had to be exported again (never, when a copy of the export was at hand)."""

    TYPE: ClassVar[str] = "takeover"
    coordinator: str = ""
    term: int = 0
    kept: int = 0
    moved: int = 0
    seconds: float = 0.0  # from winning the election to serving
    exported: bool = False

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Takeover:
        exported = d.get("exported", False)
        if not isinstance(exported, bool):
            raise ProtocolError("bad_field", "exported must be true or false")
        return Takeover(
            _at(d),
            str_field(d.get("coordinator"), "coordinator", 300),
            int_field(d.get("term", 0), "term"),
            int_field(d.get("kept", 0), "kept", 0, MAX_NODES),
            int_field(d.get("moved", 0), "moved", 0, MAX_NODES),
            float_field(d.get("seconds", 0.0), "seconds", 0.0, 1e6),
            exported,
        )


@dataclass(frozen=True)
class Preparing(Event):
    """The coordinator's preparation moved on (a step, a stage, a node's step, or its percent)."""

    TYPE: ClassVar[str] = "preparing"
    preparing: Preparation | None = None

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Preparing:
        return Preparing(_at(d), opt_preparation(d.get("preparing")))


@dataclass(frozen=True)
class CoordinatorLost(Event):
    """Said by a relay (the local agent) when the coordinator's stream broke; a new snapshot
    follows once a coordinator answers again."""

    TYPE: ClassVar[str] = "coordinator_lost"
    coordinator: str | None = None

    @classmethod
    def parse(cls, d: dict[str, Any]) -> CoordinatorLost:
        return CoordinatorLost(_at(d), opt_id_field(d.get("coordinator"), "coordinator"))


@dataclass(frozen=True)
class StreamStarted(Event):
    TYPE: ClassVar[str] = "stream_started"
    stream: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0

    @classmethod
    def parse(cls, d: dict[str, Any]) -> StreamStarted:
        return StreamStarted(
            _at(d),
            str_field(d.get("stream"), "stream", 64),
            int_field(d.get("prompt_tokens", 0), "prompt_tokens", 0, 1 << 24),
            int_field(d.get("max_tokens", 0), "max_tokens", 0, 1 << 24),
        )


@dataclass(frozen=True)
class StreamFinished(Event):
    TYPE: ClassVar[str] = "stream_finished"
    stream: str = ""
    tokens: int = 0
    seconds: float = 0.0
    ttft_s: float | None = None
    tok_s: float | None = None  # decode rate after the first token
    outcome: str = "done"  # done | cancelled | error
    nodes: tuple[str, ...] = ()
    drafted: int = 0  # speculative decoding: drafts sent to the target
    accepted: int = 0  # ... and kept by it

    @classmethod
    def parse(cls, d: dict[str, Any]) -> StreamFinished:
        nodes = d.get("nodes", [])
        if not isinstance(nodes, list | tuple) or len(nodes) > MAX_NODES:
            raise ProtocolError("bad_field", "nodes must be a list")
        return StreamFinished(
            _at(d),
            str_field(d.get("stream"), "stream", 64),
            int_field(d.get("tokens", 0), "tokens", 0, 1 << 24),
            float_field(d.get("seconds", 0.0), "seconds", 0.0, 1e7),
            opt_float(d.get("ttft_s"), "ttft_s", 0.0, 1e7),
            opt_float(d.get("tok_s"), "tok_s", 0.0, 1e7),
            choice_field(d.get("outcome", "done"), "outcome", OUTCOMES),
            tuple(str_field(n, "nodes", 128) for n in nodes),
            int_field(d.get("drafted", 0), "drafted", 0, 1 << 24),
            int_field(d.get("accepted", 0), "accepted", 0, 1 << 24),
        )


EVENTS: dict[str, type[Event]] = {
    e.TYPE: e
    for e in (
        Snapshot,
        NodeJoined,
        NodeChanged,
        NodeLeft,
        PlanChanged,
        Failover,
        Takeover,
        Preparing,
        CoordinatorLost,
        StreamStarted,
        StreamFinished,
    )
}


def parse_event(text: str | bytes) -> Event:
    """One message of the stream, checked field by field (ProtocolError when it is not one)."""
    if len(text) > MAX_EVENT_BYTES:
        raise ProtocolError("too_large", f"an event of {len(text)} bytes is over {MAX_EVENT_BYTES}")
    try:
        d = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError("bad_frame", f"an event must be JSON: {e}") from None
    if not isinstance(d, dict):
        raise ProtocolError("bad_frame", "an event must be a JSON object")
    kind = EVENTS.get(d.get("type"))  # type: ignore[arg-type]
    if kind is None:
        raise ProtocolError("unknown_type", f"unknown event type {d.get('type')!r}")
    return kind.parse(d)


def apply_event(view: ClusterView | None, ev: Event) -> ClusterView | None:
    """The cluster after ``ev`` (pure): how every reader keeps its picture current."""
    from dataclasses import replace

    if isinstance(ev, Snapshot):
        return ev.view
    if view is None:
        return None  # nothing to apply to until the first snapshot
    if isinstance(ev, NodeJoined | NodeChanged):
        others = tuple(n for n in view.nodes if n.node != ev.node.node)
        return replace(view, nodes=tuple(sorted((*others, ev.node), key=lambda n: n.node)))
    if isinstance(ev, NodeLeft):
        return replace(view, nodes=tuple(n for n in view.nodes if n.node != ev.node))
    if isinstance(ev, PlanChanged):
        where = dict(zip(ev.ring, ev.layers, strict=True))
        stage = {n: i for i, n in enumerate(ev.ring)}
        nodes = tuple(replace(n, stage=stage.get(n.node), layers=where.get(n.node)) for n in view.nodes)
        return replace(view, ring=ev.ring, nodes=nodes, model=ev.model, service=ev.service, term=ev.term)
    if isinstance(ev, Preparing):
        return replace(view, preparing=ev.preparing)
    if isinstance(ev, CoordinatorLost):
        return replace(view, coordinator=None, service="idle", streams=0, waiting=0, preparing=None)
    if isinstance(ev, StreamStarted):
        return replace(view, streams=view.streams + 1)
    if isinstance(ev, StreamFinished):
        return replace(view, streams=max(0, view.streams - 1))
    return view
