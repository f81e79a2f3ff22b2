"""What the cluster looks like to node maps and trays: its nodes, the plan, the coordinator's
preparation. The event stream (:mod:`agent.protocol.events`) carries these; every field is checked
on receipt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def opt_float(v: Any, name: str, lo: float, hi: float) -> float | None:
    return None if v is None else float_field(v, name, lo, hi)


def opt_int(v: Any, name: str, lo: int = 0, hi: int = 2**62) -> int | None:
    return None if v is None else int_field(v, name, lo, hi)


def layers_field(v: Any, name: str) -> tuple[int, int] | None:
    if v is None:
        return None
    if not isinstance(v, list | tuple) or len(v) != 2:
        raise ProtocolError("bad_field", f"{name} must be [first, end]")
    a, b = int_field(v[0], name, 0, 1 << 20), int_field(v[1], name, 0, 1 << 20)
    if b <= a:
        raise ProtocolError("bad_field", f"{name} must be a non-empty range")
    return a, b


def ids_field(v: Any, name: str, max_len: int = MAX_NODES) -> tuple[str, ...]:
    if not isinstance(v, list | tuple) or len(v) > max_len:
        raise ProtocolError("bad_field", f"{name} must be a list of at most {max_len} node ids")
    return tuple(id_field(x, name) for x in v)


def mapping_field(v: Any, name: str) -> dict[str, Any]:
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
        d = mapping_field(d, "node")
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
            temp_c=opt_float(d.get("temp_c"), "temp_c", -100.0, 300.0),
            tok_s=float_field(d.get("tok_s", 0.0), "tok_s", 0.0, 1e7),
            rtt_ms=opt_float(d.get("rtt_ms"), "rtt_ms", 0.0, 1e6),
            next_rtt_ms=opt_float(d.get("next_rtt_ms"), "next_rtt_ms", 0.0, 1e6),
            stage=opt_int(d.get("stage"), "stage", 0, MAX_NODES),
            layers=layers_field(d.get("layers"), "layers"),
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
        d = mapping_field(d, "nodes[]")
        return NodeStep(
            id_field(d.get("node"), "node"),
            choice_field(d.get("step"), "step", NODE_STEPS),
            opt_float(d.get("percent"), "percent", 0.0, 100.0),
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
        d = mapping_field(d, "preparing")
        nodes = d.get("nodes", [])
        if not isinstance(nodes, list | tuple) or len(nodes) > MAX_NODES:
            raise ProtocolError("bad_field", f"nodes must be a list of at most {MAX_NODES}")
        stage = opt_int(d.get("stage"), "stage", 0, MAX_NODES)
        stages = opt_int(d.get("stages"), "stages", 1, MAX_NODES)
        if stage is not None and (stages is None or stage >= stages):
            raise ProtocolError("bad_field", "stage must be below stages")
        return Preparation(
            model=str_field(d.get("model"), "model", 300),
            step=choice_field(d.get("step"), "step", PREP_STEPS),
            stage=stage,
            stages=stages,
            percent=opt_float(d.get("percent"), "percent", 0.0, 100.0),
            detail=opt_str_field(d.get("detail"), "detail", 200),
            error=opt_str_field(d.get("error"), "error", 2000),
            nodes=tuple(NodeStep.parse(n) for n in nodes),
        )


def opt_preparation(v: Any) -> Preparation | None:
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
        d = mapping_field(d, "view")
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
            ring=ids_field(d.get("ring", []), "ring"),
            nodes=tuple(NodeInfo.parse(n) for n in nodes),
            streams=int_field(d.get("streams", 0), "streams", 0, 1 << 20),
            waiting=int_field(d.get("waiting", 0), "waiting", 0, 1 << 20),
            preparing=opt_preparation(d.get("preparing")),
        )
