"""The local agent's status answers, typed: ``GET /v1/node`` (:class:`NodeStatus`, its stage in
:class:`StageStatus`) and ``GET /v1/cluster`` (:class:`ClusterStatus`, each peer a :class:`PeerStatus`).

The daemon builds these and sends ``to_json()``; ``lakeshard status`` and the tray read them back
with ``parse``, which checks every typed field and raises :class:`ProtocolError` saying which one is
wrong. Why a node is limited or paused travels twice: ``reason``, free text for people ("92 C"),
and ``reason_kind``, a :class:`PauseReason` for programs (the tray's heat icon). An older agent
sends no ``reason_kind`` (None here); readers then fall back to the words.

The JSON keeps the keys it always had. Parts no reader needs typed (the throttle's readings, the
coordinator's services, the election's history, ...) are carried unread in ``details``: a newer
agent's extra keys pass through an older reader, and ``parse(s.to_json()) == s``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

from agent.protocol.cluster_view import (
    MAX_NODES,
    NODE_ROLES,
    layers_field,
    mapping_field,
    opt_float,
    opt_int,
)
from agent.protocol.codec import ProtocolError, float_field, int_field, opt_device_field, opt_str_field
from agent.protocol.control import (
    MAX_MEM,
    MAX_SCORE,
    ROLES,
    STATES,
    DeviceOffer,
    bool_field,
    choice_field,
    id_field,
    kinds_field,
    opt_id_field,
)

NO_CLUSTER = "no_cluster"  # state and role of an agent that waits for 'cluster init' or 'join'
MODES = ("pause", "limit", "run")  # what the user's input, or a battery, does (agent.throttle.policy.MODES)
NODE_STATES = (*STATES, NO_CLUSTER)
STATUS_ROLES = (*NODE_ROLES, NO_CLUSTER)
MAX_PORT = 65535


class PauseReason(enum.StrEnum):
    """What a node's limit or pause is about (``reason_kind`` on the wire)."""

    INPUT = "input"  # its user is using the laptop (the throttle's cause "user")
    SWITCH = "switch"  # its user's own switch: the tray's "Pause contributing", the status API
    HEAT = "heat"  # the chassis is hot
    BATTERY = "battery"  # on battery, or its charge is low
    SCHEDULE = "schedule"  # outside the hours or days set for contributing (cause "hours")
    LID = "lid"  # the lid is closed
    LOAD = "load"  # other programs use the CPU
    GPU = "gpu"  # other programs use the GPU
    OTHER = "other"  # a kind this version does not know (a newer agent's)

    @classmethod
    def from_cause(cls, cause: str) -> PauseReason | None:
        """The kind of a throttle policy's ``Decision.cause`` ('' or unknown: None)."""
        return _CAUSES.get(cause)

    @property
    def heat_or_battery(self) -> bool:
        """Whether the machine, not its user, made it so (news worth a notification)."""
        return self in (PauseReason.HEAT, PauseReason.BATTERY)


_CAUSES = {
    "user": PauseReason.INPUT,
    "hours": PauseReason.SCHEDULE,
    "heat": PauseReason.HEAT,
    "battery": PauseReason.BATTERY,
    "lid": PauseReason.LID,
    "load": PauseReason.LOAD,
    "gpu": PauseReason.GPU,
}


def reason_kind_field(v: Any, name: str = "reason_kind") -> PauseReason | None:
    """None, or a kind; a kind this version does not know reads as OTHER (a newer agent's)."""
    if v is None:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= 32:
        raise ProtocolError("bad_field", f"{name} must be null or a short string such as 'heat', got {v!r}")
    try:
        return PauseReason(v)
    except ValueError:
        return PauseReason.OTHER


def _opt_bool(v: Any, name: str) -> bool | None:
    return None if v is None else bool_field(v, name)


def _opt_choice(v: Any, name: str, options: tuple[str, ...]) -> str | None:
    return None if v is None else choice_field(v, name, options)


def _attention(v: Any) -> str | None:
    if v is not None and v not in ("paged", "stateful"):
        raise ProtocolError("bad_field", "stage.attention must be paged or stateful")
    return v  # type: ignore[no-any-return]


def _hours(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > 11:
        raise ProtocolError("bad_field", f"throttle_policy.hours must be null or like 08:00-19:00, got {v!r}")
    return v


@dataclass(frozen=True)
class ThrottlePolicy:
    """When this laptop yields to its user: the settings its throttle runs with (``/v1/node``'s
    ``throttle_policy``), so that a reader can say when a pause or a limit ends ("contributes again
    after 2 min idle") and whether it contributes while its user works."""

    enabled: bool = True
    idle_minutes: float = 2.0  # no input for this long before contributing fully again
    while_in_use: str = "pause"  # what input does: pause, limit or run (MODES)
    temp_low_c: float = 80.0  # paused for heat until at or below this
    on_battery: str = "pause"  # MODES
    battery_floor_pct: float = 30.0  # below this charge: paused whatever on_battery says
    cpu_low_pct: float = 30.0  # limited for load until other programs use at most this much
    gpu_low_pct: float = 20.0
    hours: str | None = None  # "08:00-19:00": contributes only then (None: any time)
    input_waived: bool = False  # resumed while in use: limited, not paused, until its user leaves it

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def parse(cls, d: Any) -> ThrottlePolicy:
        d = mapping_field(d, "throttle_policy")

        def num(key: str, default: float, lo: float, hi: float) -> float:
            return float_field(d.get(key, default), f"throttle_policy.{key}", lo, hi)

        def mode(key: str) -> str:
            return choice_field(d.get(key, "pause"), f"throttle_policy.{key}", MODES)

        return ThrottlePolicy(
            enabled=bool_field(d.get("enabled", True), "throttle_policy.enabled"),
            idle_minutes=num("idle_minutes", 2.0, 0.0, 24 * 60),
            while_in_use=mode("while_in_use"),
            temp_low_c=num("temp_low_c", 80.0, -100.0, 300.0),
            on_battery=mode("on_battery"),
            battery_floor_pct=num("battery_floor_pct", 30.0, 0.0, 100.0),
            cpu_low_pct=num("cpu_low_pct", 30.0, 0.0, 100.0),
            gpu_low_pct=num("gpu_low_pct", 20.0, 0.0, 100.0),
            hours=_hours(d.get("hours")),
            input_waived=bool_field(d.get("input_waived", False), "throttle_policy.input_waived"),
        )


def _details(d: dict[str, Any], typed: type) -> dict[str, Any]:
    """The keys of ``d`` that ``typed`` has no field for, carried as they came."""
    names = {f.name for f in fields(typed)}
    return {k: v for k, v in d.items() if k not in names}


def _json(obj: Any) -> dict[str, Any]:
    """A status object's fields as JSON: tuples as lists, enums as values, ``details`` merged in."""
    out: dict[str, Any] = dict(getattr(obj, "details", {}))
    for f in fields(obj):
        if f.name == "details":
            continue
        v = getattr(obj, f.name)
        if isinstance(v, StageStatus | ThrottlePolicy):
            v = v.to_json()
        elif isinstance(v, tuple):
            v = [x.to_json() if isinstance(x, PeerStatus) else list(x) if isinstance(x, tuple) else x for x in v]
        elif isinstance(v, PauseReason):
            v = v.value
        out[f.name] = v
    return out


def _rows_ms(v: Any) -> dict[int, float] | None:
    """``{"1": ms, "8": ms}``: batch sizes (1..65536) to median step times."""
    if v is None:
        return None
    m = mapping_field(v, "stage.step_ms_by_rows")
    if len(m) > 32:
        raise ProtocolError("bad_field", "stage.step_ms_by_rows has more than 32 sizes")
    out = {}
    for k, t in m.items():
        if not isinstance(k, str) or not k.isdigit() or not 1 <= int(k) <= 1 << 16:
            raise ProtocolError("bad_field", f"stage.step_ms_by_rows: {k!r} is not a batch size")
        out[int(k)] = float_field(t, f"stage.step_ms_by_rows.{k}", 0.0, 1e9)
    return out


@dataclass(frozen=True)
class StageStatus:
    """The stage this node serves (``/v1/node``'s ``stage``): which layers, and how it runs."""

    assigned: bool = False
    stage: int | None = None  # its place in the ring, from 0
    stages: int | None = None
    layers: tuple[int, int] | None = None  # [first, end) of the model's layers
    model: str | None = None
    model_layers: int | None = None
    device: str | None = None
    term: int | None = None  # the coordinator's term it was assigned in
    term_seen: int = 0
    streams: int = 0
    frames: int = 0
    errors: int = 0
    step_ms_p50: float | None = None  # its median step lately, for calibration
    next_rtt_ms: float | None = None
    paused: str | None = None  # why it refuses steps now
    preparing: str | None = None  # "fetching" or "compiling" an assignment
    threads: int | None = None
    attention: str | None = None  # "paged" or "stateful" (None: no stage; older agents)
    kv_blocks_total: int | None = None  # a paged stage's KV block pool
    kv_blocks_free: int | None = None
    step_ms_by_rows: dict[int, float] | None = None  # a paged stage's median step (ms) by batch size
    details: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self) -> dict[str, Any]:
        out = _json(self)
        if self.step_ms_by_rows is not None:
            out["step_ms_by_rows"] = {str(k): v for k, v in self.step_ms_by_rows.items()}
        for k in ("kv_blocks_total", "kv_blocks_free", "step_ms_by_rows"):  # none on a stateful stage
            if out[k] is None:
                del out[k]
        return out

    @classmethod
    def parse(cls, d: Any) -> StageStatus:
        d = mapping_field(d, "stage")
        stage, stages = (
            opt_int(d.get("stage"), "stage.stage", 0, MAX_NODES),
            opt_int(d.get("stages"), "stage.stages", 1),
        )
        if stage is not None and (stages is None or stage >= stages):
            raise ProtocolError("bad_field", "stage.stage must be below stage.stages")
        total = opt_int(d.get("kv_blocks_total"), "stage.kv_blocks_total", 1, 1 << 32)
        return StageStatus(
            assigned=bool_field(d.get("assigned", False), "stage.assigned"),
            stage=stage,
            stages=stages,
            layers=layers_field(d.get("layers"), "stage.layers"),
            model=opt_str_field(d.get("model"), "stage.model", 300),
            model_layers=opt_int(d.get("model_layers"), "stage.model_layers", 1, 1 << 20),
            device=opt_device_field(d.get("device"), "stage.device"),
            term=opt_int(d.get("term"), "stage.term"),
            term_seen=int_field(d.get("term_seen", 0), "stage.term_seen"),
            streams=int_field(d.get("streams", 0), "stage.streams", 0, 1 << 20),
            frames=int_field(d.get("frames", 0), "stage.frames"),
            errors=int_field(d.get("errors", 0), "stage.errors"),
            step_ms_p50=opt_float(d.get("step_ms_p50"), "stage.step_ms_p50", 0.0, 1e9),
            next_rtt_ms=opt_float(d.get("next_rtt_ms"), "stage.next_rtt_ms", 0.0, 1e6),
            paused=opt_str_field(d.get("paused"), "stage.paused", 200),
            preparing=opt_str_field(d.get("preparing"), "stage.preparing", 64),
            threads=opt_int(d.get("threads"), "stage.threads", 1, 1 << 16),
            attention=_attention(d.get("attention")),
            kv_blocks_total=total,
            kv_blocks_free=opt_int(d.get("kv_blocks_free"), "stage.kv_blocks_free", 0, total or 0),
            step_ms_by_rows=_rows_ms(d.get("step_ms_by_rows")),
            details=_details(d, StageStatus),
        )


@dataclass(frozen=True)
class NodeStatus:
    """``GET /v1/node``: this laptop's part in its cluster. Only ``node`` and ``state`` are required
    (an agent with no cluster yet answers little more)."""

    node: str
    state: str  # available | limited | paused | no_cluster
    reason: str | None = None  # why it is limited or paused, in words ("92 C", "user")
    reason_kind: PauseReason | None = None  # the same for programs (None: none, or an older agent)
    name: str | None = None  # the laptop's host name
    cluster: str | None = None
    version: str = ""
    role: str = "standalone"
    term: int = 0
    coordinator: str | None = None
    paused_until: float | None = None  # wall clock: the user's timed pause ends then
    throttle_policy: ThrottlePolicy | None = None  # when it yields to its user (None: an older agent)
    tok_s: float = 0.0
    temp_c: float | None = None
    port: int | None = None
    api_port: int | None = None
    mdns: bool = False
    links: str | None = None  # mtls | plaintext
    mem_total: int = 0
    mem_free: int = 0
    speed_score: float = 0.0
    devices: tuple[str, ...] = ()
    stage: StageStatus = field(default_factory=StageStatus)
    peers: int = 0  # live peers it hears
    holds_ca: bool = False  # whether this laptop holds its cluster's CA
    hint: str | None = None  # no cluster yet: what to do
    error: str | None = None  # no cluster yet: why its last start as a member failed
    log_dir: str | None = None
    config_file: str | None = None
    started: float | None = None
    details: dict[str, Any] = field(default_factory=dict, compare=False)  # model, throttle, capacity, ...

    def to_json(self) -> dict[str, Any]:
        return _json(self)

    @classmethod
    def parse(cls, d: Any) -> NodeStatus:
        d = mapping_field(d, "node status")
        mem_total = int_field(d.get("mem_total", 0), "mem_total", 0, MAX_MEM)
        return NodeStatus(
            node=id_field(d.get("node"), "node"),
            state=choice_field(d.get("state"), "state", NODE_STATES),
            reason=opt_str_field(d.get("reason"), "reason", 200),
            reason_kind=reason_kind_field(d.get("reason_kind")),
            name=opt_str_field(d.get("name"), "name", 128),
            cluster=opt_id_field(d.get("cluster"), "cluster"),
            version=str(d.get("version") or "")[:32],
            role=choice_field(d.get("role", "standalone"), "role", STATUS_ROLES),
            term=int_field(d.get("term", 0), "term"),
            coordinator=opt_id_field(d.get("coordinator"), "coordinator"),
            paused_until=opt_float(d.get("paused_until"), "paused_until", 0.0, 1e11),
            throttle_policy=None if d.get("throttle_policy") is None else ThrottlePolicy.parse(d["throttle_policy"]),
            tok_s=float_field(d.get("tok_s", 0.0), "tok_s", 0.0, 1e7),
            temp_c=opt_float(d.get("temp_c"), "temp_c", -100.0, 300.0),
            port=opt_int(d.get("port"), "port", 1, MAX_PORT),
            api_port=opt_int(d.get("api_port"), "api_port", 1, MAX_PORT),
            mdns=bool_field(d.get("mdns", False), "mdns"),
            links=opt_str_field(d.get("links"), "links", 32),
            mem_total=mem_total,
            mem_free=int_field(d.get("mem_free", 0), "mem_free", 0, MAX_MEM),
            speed_score=float_field(d.get("speed_score", 0.0), "speed_score", 0.0, MAX_SCORE),
            devices=kinds_field(d.get("devices", []), "devices"),
            stage=StageStatus.parse(d.get("stage", {})),
            peers=int_field(d.get("peers", 0), "peers", 0, MAX_NODES),
            holds_ca=bool_field(d.get("holds_ca", False), "holds_ca"),
            hint=opt_str_field(d.get("hint"), "hint", 2000),
            error=opt_str_field(d.get("error"), "error", 2000),
            log_dir=opt_str_field(d.get("log_dir"), "log_dir", 4096),
            config_file=opt_str_field(d.get("config_file"), "config_file", 4096),
            started=opt_float(d.get("started"), "started", 0.0, 1e11),
            details=_details(d, NodeStatus),
        )


@dataclass(frozen=True)
class PeerStatus:
    """One peer as ``/v1/cluster`` lists it: where it is, and its latest beat's figures (None before one)."""

    node: str
    address: str  # host:port its datagrams come from
    alive: bool
    last_heard_s: float | None = None  # seconds since its last datagram (None: never)
    first_seen: float | None = None  # wall clock
    first_heard: float | None = None
    role: str | None = None
    term: int | None = None
    state: str | None = None
    reason: str | None = None
    reason_kind: PauseReason | None = None  # None: none, or a peer too old to say
    eligible: bool | None = None
    score: float | None = None
    mem_free: int | None = None
    devices: tuple[str, ...] = ()
    offers: tuple[DeviceOffer, ...] = ()
    version: str | None = None
    name: str | None = None
    rtt_ms: float | None = None
    details: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self) -> dict[str, Any]:
        out = _json(self)
        out["offers"] = [
            {"name": o.name, "score": o.score, "mem_free": o.mem_free, "own_memory": o.own_memory} for o in self.offers
        ]
        return out

    @classmethod
    def parse(cls, d: Any) -> PeerStatus:
        d = mapping_field(d, "peers[]")
        offers = d.get("offers", [])
        if not isinstance(offers, list) or len(offers) > 16:
            raise ProtocolError("bad_field", "peers[].offers must be a list of at most 16 device offers")
        return PeerStatus(
            node=id_field(d.get("node"), "peers[].node"),
            address=opt_str_field(d.get("address"), "peers[].address", 300) or "",
            alive=bool_field(d.get("alive"), "peers[].alive"),
            last_heard_s=opt_float(d.get("last_heard_s"), "peers[].last_heard_s", 0.0, 1e11),
            first_seen=opt_float(d.get("first_seen"), "peers[].first_seen", 0.0, 1e11),
            first_heard=opt_float(d.get("first_heard"), "peers[].first_heard", 0.0, 1e11),
            role=_opt_choice(d.get("role"), "peers[].role", ROLES),
            term=opt_int(d.get("term"), "peers[].term"),
            state=_opt_choice(d.get("state"), "peers[].state", STATES),
            reason=opt_str_field(d.get("reason"), "peers[].reason", 200),
            reason_kind=reason_kind_field(d.get("reason_kind"), "peers[].reason_kind"),
            eligible=_opt_bool(d.get("eligible"), "peers[].eligible"),
            score=opt_float(d.get("score"), "peers[].score", 0.0, MAX_SCORE),
            mem_free=opt_int(d.get("mem_free"), "peers[].mem_free", 0, MAX_MEM),
            devices=kinds_field(d.get("devices", []), "peers[].devices"),
            offers=tuple(_offer(o) for o in offers),
            version=opt_str_field(d.get("version"), "peers[].version", 32),
            name=opt_str_field(d.get("name"), "peers[].name", 128),
            rtt_ms=opt_float(d.get("rtt_ms"), "peers[].rtt_ms", 0.0, 1e6),
            details=_details(d, PeerStatus),
        )


def _offer(v: Any) -> DeviceOffer:
    o = mapping_field(v, "peers[].offers[]")
    return DeviceOffer.parse(
        [o.get("name"), o.get("score"), o.get("mem_free"), o.get("own_memory")], "peers[].offers[]"
    )


@dataclass(frozen=True)
class ClusterStatus:
    """``GET /v1/cluster``: the cluster as this node's election sees it. A standalone node, or one
    with no cluster yet, answers only ``node``, ``role``, ``term``, ``coordinator`` and no peers."""

    node: str
    role: str
    term: int = 0
    coordinator: str | None = None
    peers: tuple[PeerStatus, ...] = ()
    cluster: str | None = None
    coordinator_since: float | None = None
    eligible: bool | None = None  # whether this node stands for coordinator
    not_eligible_because: str | None = None
    state: str | None = None
    reason: str | None = None
    reason_kind: PauseReason | None = None
    links: str | None = None
    hint: str | None = None
    details: dict[str, Any] = field(default_factory=dict, compare=False)  # services, model, history, ...

    def to_json(self) -> dict[str, Any]:
        return _json(self)

    @classmethod
    def parse(cls, d: Any) -> ClusterStatus:
        d = mapping_field(d, "cluster status")
        peers = d.get("peers", [])
        if not isinstance(peers, list) or len(peers) > MAX_NODES:
            raise ProtocolError("bad_field", f"peers must be a list of at most {MAX_NODES}")
        return ClusterStatus(
            node=id_field(d.get("node"), "node"),
            role=choice_field(d.get("role"), "role", STATUS_ROLES),
            term=int_field(d.get("term", 0), "term"),
            coordinator=opt_id_field(d.get("coordinator"), "coordinator"),
            peers=tuple(PeerStatus.parse(p) for p in peers),
            cluster=opt_id_field(d.get("cluster"), "cluster"),
            coordinator_since=opt_float(d.get("coordinator_since"), "coordinator_since", 0.0, 1e11),
            eligible=_opt_bool(d.get("eligible"), "eligible"),
            not_eligible_because=opt_str_field(d.get("not_eligible_because"), "not_eligible_because", 500),
            state=_opt_choice(d.get("state"), "state", STATES),
            reason=opt_str_field(d.get("reason"), "reason", 200),
            reason_kind=reason_kind_field(d.get("reason_kind")),
            links=opt_str_field(d.get("links"), "links", 32),
            hint=opt_str_field(d.get("hint"), "hint", 2000),
            details=_details(d, ClusterStatus),
        )
