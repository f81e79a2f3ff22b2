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

from agent.protocol.codec import ProtocolError, float_field, int_field, opt_str_field, str_field
from agent.protocol.control import ROLES, STATES, bool_field, choice_field, id_field, kinds_field, opt_id_field

MAX_NODES = 1024
MAX_EVENT_BYTES = 4 * 1024 * 1024  # a snapshot of MAX_NODES nodes fits well within this
NODE_ROLES = (*ROLES, "standalone")
SERVICES = ("idle", "no model", "planning", "assigning", "serving", "re-planning", "recovering", "failed")
OUTCOMES = ("done", "cancelled", "error")
# what the coordinator does before it can answer (see Preparation), in the order it does it
PREP_STEPS = ("planning", "pulling", "exporting", "sending", "compiling", "ready", "failed")
# one node's part of it: its stage's files on the way, being compiled, in place
NODE_STEPS = ("waiting", "sending", "compiling", "ready", "failed")


def _opt_float(v: Any, name: str, lo: float, hi: float) -> float | None:
    return None if v is None else float_field(v, name, lo, hi)


def _opt_int(v: Any, name: str, lo: int = 0, hi: int = 2**62) -> int | None:
    return None if v is None else int_field(v, name, lo, hi)


def _layers(v: Any, name: str) -> tuple[int, int] | None:
    if v is None:
        return None
    if not isinstance(v, list | tuple) or len(v) != 2:
        raise ProtocolError("bad_field", f"{name} must be [first, end]")
    a, b = int_field(v[0], name, 0, 1 << 20), int_field(v[1], name, 0, 1 << 20)
    if b <= a:
        raise ProtocolError("bad_field", f"{name} must be a non-empty range")
    return a, b


def _ids(v: Any, name: str, max_len: int = MAX_NODES) -> tuple[str, ...]:
    if not isinstance(v, list | tuple) or len(v) > max_len:
        raise ProtocolError("bad_field", f"{name} must be a list of at most {max_len} node ids")
    return tuple(id_field(x, name) for x in v)


def _mapping(v: Any, name: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ProtocolError("bad_field", f"{name} must be an object")
    return v


@dataclass(frozen=True)
class NodeInfo:
    """One node as the coordinator sees it (from its beats, its stage and the plan)."""

    node: str
    name: str  # the laptop's host name
    address: str  # host:port of its agent
    role: str
    state: str  # available | limited | paused
    reason: str | None = None  # why it is limited or paused ("user", "92 C", "on battery")
    alive: bool = True
    devices: tuple[str, ...] = ("CPU",)
    mem_free: int = 0
    mem_total: int = 0
    score: float = 0.0  # measured speed, GFLOP/s
    temp_c: float | None = None
    tok_s: float = 0.0  # positions its stage computed per second, lately
    rtt_ms: float | None = None  # round trip coordinator <-> node (beat and acknowledgement)
    next_rtt_ms: float | None = None  # round trip from its stage to the next agent of the ring
    stage: int | None = None
    layers: tuple[int, int] | None = None  # [first, end) of the model's layers it serves
    version: str = ""

    @classmethod
    def parse(cls, d: Any) -> NodeInfo:
        d = _mapping(d, "node")
        mem_total = int_field(d.get("mem_total", 0), "mem_total", 0, 1 << 50)
        return NodeInfo(
            node=id_field(d.get("node"), "node"),
            name=str_field(d.get("name"), "name", 128),
            address=str_field(d.get("address"), "address", 300),
            role=choice_field(d.get("role"), "role", NODE_ROLES),
            state=choice_field(d.get("state"), "state", STATES),
            reason=opt_str_field(d.get("reason"), "reason", 200),
            alive=bool_field(d.get("alive", True), "alive"),
            devices=kinds_field(d.get("devices", ["CPU"]), "devices"),
            mem_free=int_field(d.get("mem_free", 0), "mem_free", 0, max(mem_total, 0) or 1 << 50),
            mem_total=mem_total,
            score=float_field(d.get("score", 0.0), "score", 0.0, 1e7),
            temp_c=_opt_float(d.get("temp_c"), "temp_c", -100.0, 300.0),
            tok_s=float_field(d.get("tok_s", 0.0), "tok_s", 0.0, 1e7),
            rtt_ms=_opt_float(d.get("rtt_ms"), "rtt_ms", 0.0, 1e6),
            next_rtt_ms=_opt_float(d.get("next_rtt_ms"), "next_rtt_ms", 0.0, 1e6),
            stage=_opt_int(d.get("stage"), "stage", 0, MAX_NODES),
            layers=_layers(d.get("layers"), "layers"),
            version=str(d.get("version", ""))[:32],
        )


@dataclass(frozen=True)
class NodeStep:
    """One node's part of a preparation: ``percent`` of its stage's files received (sending)."""

    node: str
    step: str  # NODE_STEPS
    percent: float | None = None

    def describe(self) -> str:
        """The node's step in words, as a node map writes it under the node (pure)."""
        if self.step == "sending":
            return "downloading its stage" + ("" if self.percent is None else f", {self.percent:.0f}%")
        return {"waiting": "waiting for its stage", "compiling": "compiling its stage…"}.get(self.step, self.step)

    @classmethod
    def parse(cls, d: Any) -> NodeStep:
        d = _mapping(d, "nodes[]")
        return NodeStep(
            id_field(d.get("node"), "node"),
            choice_field(d.get("step"), "step", NODE_STEPS),
            _opt_float(d.get("percent"), "percent", 0.0, 100.0),
        )


@dataclass(frozen=True)
class Preparation:
    """What the coordinator does before its API can answer, now: planning, pulling the model, exporting
    its stages (``stage`` of ``stages``, counted from 0), sending them to the nodes, each node
    compiling its own; then ready (or failed, with the ``error``). ``percent`` is of the whole
    step (exporting: over all stages); ``detail`` says what part of it runs ("compressing weights")."""

    model: str
    step: str  # PREP_STEPS
    stage: int | None = None
    stages: int | None = None
    percent: float | None = None
    detail: str | None = None
    error: str | None = None
    nodes: tuple[NodeStep, ...] = ()

    def node(self, node: str) -> NodeStep | None:
        return next((n for n in self.nodes if n.node == node), None)

    def steps(self) -> tuple[object, ...]:
        """What makes a new step (what ``percent`` and ``detail`` alone do not)."""
        return (self.model, self.step, self.stage, self.stages, self.error, tuple((n.node, n.step) for n in self.nodes))

    def describe(self) -> str:
        """The step in words: 'exporting stage 2 of 3 (compressing weights), 40%' (pure)."""
        pct = "" if self.percent is None else f", {self.percent:.0f}%"
        detail = f" ({self.detail})" if self.detail else ""
        if self.step == "planning":
            return f"planning the split over the nodes{detail}"
        if self.step == "pulling":
            return f"downloading the model{detail}{pct}"
        if self.step == "exporting":
            which = f" stage {self.stage + 1} of {self.stages}" if self.stage is not None and self.stages else ""
            return f"exporting{which}{detail}{pct}"
        n = len(self.nodes)
        nodes = f"{n} node{'' if n == 1 else 's'}"
        if self.step == "sending":
            return f"sending the stages to {nodes}{pct}"
        if self.step == "compiling":
            done = sum(1 for x in self.nodes if x.step == "ready")
            return f"compiling on {nodes} ({done} ready)" if n > 1 else "compiling"
        if self.step == "failed":
            return f"failed: {self.error or 'no reason given'}"
        return "ready"

    @classmethod
    def parse(cls, d: Any) -> Preparation:
        d = _mapping(d, "preparing")
        nodes = d.get("nodes", [])
        if not isinstance(nodes, list | tuple) or len(nodes) > MAX_NODES:
            raise ProtocolError("bad_field", f"nodes must be a list of at most {MAX_NODES}")
        stage = _opt_int(d.get("stage"), "stage", 0, MAX_NODES)
        stages = _opt_int(d.get("stages"), "stages", 1, MAX_NODES)
        if stage is not None and (stages is None or stage >= stages):
            raise ProtocolError("bad_field", "stage must be below stages")
        return Preparation(
            model=str_field(d.get("model"), "model", 300),
            step=choice_field(d.get("step"), "step", PREP_STEPS),
            stage=stage,
            stages=stages,
            percent=_opt_float(d.get("percent"), "percent", 0.0, 100.0),
            detail=opt_str_field(d.get("detail"), "detail", 200),
            error=opt_str_field(d.get("error"), "error", 2000),
            nodes=tuple(NodeStep.parse(n) for n in nodes),
        )


def _opt_preparation(v: Any) -> Preparation | None:
    return None if v is None else Preparation.parse(v)


@dataclass(frozen=True)
class ClusterView:
    """The whole cluster at one moment, as its coordinator sees it."""

    cluster: str
    coordinator: str | None
    term: int
    model: str | None = None
    service: str = "idle"  # what the coordinator's services are doing (SERVICES)
    error: str | None = None
    ring: tuple[str, ...] = ()  # node ids in stage order
    nodes: tuple[NodeInfo, ...] = ()
    streams: int = 0  # requests being answered now
    waiting: int = 0  # requests waiting for a slot
    preparing: Preparation | None = None  # the model being made ready, step by step (None: nothing yet)

    def node(self, node: str) -> NodeInfo | None:
        return next((n for n in self.nodes if n.node == node), None)

    @classmethod
    def parse(cls, d: Any) -> ClusterView:
        d = _mapping(d, "view")
        nodes = d.get("nodes", [])
        if not isinstance(nodes, list) or len(nodes) > MAX_NODES:
            raise ProtocolError("bad_field", f"nodes must be a list of at most {MAX_NODES}")
        return ClusterView(
            cluster=id_field(d.get("cluster"), "cluster"),
            coordinator=opt_id_field(d.get("coordinator"), "coordinator"),
            term=int_field(d.get("term", 0), "term"),
            model=opt_str_field(d.get("model"), "model", 300),
            service=choice_field(d.get("service", "idle"), "service", SERVICES),
            error=opt_str_field(d.get("error"), "error", 2000),
            ring=_ids(d.get("ring", []), "ring"),
            nodes=tuple(NodeInfo.parse(n) for n in nodes),
            streams=int_field(d.get("streams", 0), "streams", 0, 1 << 20),
            waiting=int_field(d.get("waiting", 0), "waiting", 0, 1 << 20),
            preparing=_opt_preparation(d.get("preparing")),
        )


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
        ring = _ids(d.get("ring", []), "ring")
        raw = d.get("layers", [])
        if not isinstance(raw, list | tuple) or len(raw) != len(ring):
            raise ProtocolError("bad_field", "layers must give one [first, end] per ring node")
        layers = tuple(_layers(x, "layers") or (0, 1) for x in raw)
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
        return Preparing(_at(d), _opt_preparation(d.get("preparing")))


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
            _opt_float(d.get("ttft_s"), "ttft_s", 0.0, 1e7),
            _opt_float(d.get("tok_s"), "tok_s", 0.0, 1e7),
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
