"""What the tray shows, as pure functions of what the local agent and the coordinator say.

``tray_state`` picks the icon, ``status_line`` the menu's first line (and the tooltip's), with a
pause or a limit explained: why, and when it ends, from the throttle policy the agent runs with
("paused while you use this laptop; contributes again after 2 min idle"); ``notices`` the
notifications worth a user's attention about this laptop, and :class:`CoordinatorWatch` those
about the cluster's coordinator, from the event stream's facts: "lost" only when the coordinator
did not come back, with a follow-up once one coordinates. They read the agent's typed
``/v1/node`` (:class:`NodeStatus`): why it is paused comes from its ``reason_kind``, and only from
the words of its ``reason`` for an agent too old to send one. No Qt here: table tests cover every case.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from agent.protocol.events import CoordinatorLost, Event, Failover, Snapshot
from agent.protocol.status import NO_CLUSTER, NodeStatus, PauseReason, ThrottlePolicy


class TrayState(enum.StrEnum):
    AVAILABLE = "available"  # idle, offering its capacity
    SERVING = "serving"  # computing for the cluster right now
    LIMITED = "limited"  # contributing less (the laptop is busy or warm)
    PAUSED_USER = "paused-user"  # paused by its user, or because its user is active
    PAUSED_HEAT = "paused-heat"  # paused because it is hot or on battery
    COORDINATOR = "coordinator"  # coordinating the cluster
    ERROR = "error"  # the agent failed or cannot be reached
    NO_CLUSTER = "no-cluster"  # not in a cluster yet, or no coordinator (alone, starting, an election)


TOOLTIPS = {
    TrayState.AVAILABLE: "available",
    TrayState.SERVING: "serving",
    TrayState.LIMITED: "limited",
    TrayState.PAUSED_USER: "paused",
    TrayState.PAUSED_HEAT: "paused (heat or battery)",
    TrayState.COORDINATOR: "coordinating the cluster",
    TrayState.ERROR: "error",
    TrayState.NO_CLUSTER: "no cluster",
}

HEAT_OR_BATTERY = ("heat", "hot", "temperature", "thermal", "battery", "power")  # an older agent's words
USER = "user"  # an older agent's reason for its user's own pause


def waiting_for_cluster(node: NodeStatus | None) -> bool:
    """Whether the agent is in no cluster yet (the menu then offers to make or join one)."""
    return node is not None and node.state == NO_CLUSTER


def holds_ca(node: NodeStatus | None) -> bool:
    """Whether this laptop holds its cluster's CA (it can invite laptops and revoke them)."""
    return node is not None and node.state != NO_CLUSTER and node.holds_ca


def reason_kind(reason: str | None, kind: PauseReason | None = None) -> str:
    """'heat' for heat or battery reasons, 'user' for everything else a user causes, '' for none.

    ``kind``: the agent's typed reason; None (an older agent) falls back to the words of ``reason``."""
    if kind is not None:
        return "heat" if kind.heat_or_battery else "user"
    if not reason:
        return ""
    r = reason.lower()
    if any(w in r for w in HEAT_OR_BATTERY) or r.rstrip().endswith((" c", "°c")):
        return "heat"
    return "user"


def can_resume(node: NodeStatus | None) -> bool:
    """Whether "Resume contributing" applies: its user's own switch paused or limited it, or its
    user's input paused it (resuming then contributes, limited, while they work)."""
    if node is None or node.state not in ("paused", "limited"):
        return False
    if node.reason_kind is None:  # an older agent: only its own switch can be undone
        return node.reason == USER
    return node.reason_kind is PauseReason.SWITCH or (node.state == "paused" and node.reason_kind is PauseReason.INPUT)


def contributes_while_working(node: NodeStatus | None) -> bool | None:
    """Whether the agent contributes (limited) while its user works instead of pausing (None: unknown)."""
    if node is None or node.throttle_policy is None:
        return None
    return node.throttle_policy.while_in_use != "pause"


def paused_by_user(node: NodeStatus | None) -> bool:
    """Whether its user's own switch paused it (the menu then offers to resume)."""
    if node is None or node.state != "paused":
        return False
    if node.reason_kind is not None:
        return node.reason_kind is PauseReason.SWITCH
    return node.reason == USER


def tray_state(node: NodeStatus | None, error: str | None = None) -> TrayState:
    """The icon for the local agent's ``/v1/node`` (None: it does not answer)."""
    if error:
        return TrayState.ERROR
    if node is None:
        return TrayState.NO_CLUSTER
    state = node.state
    if state == NO_CLUSTER:
        return TrayState.NO_CLUSTER
    if state == "paused":
        heat = reason_kind(node.reason, node.reason_kind) == "heat"
        return TrayState.PAUSED_HEAT if heat else TrayState.PAUSED_USER
    if state == "limited":
        return TrayState.LIMITED
    if not node.coordinator:
        return TrayState.NO_CLUSTER
    if node.tok_s > 0 and node.stage.assigned:
        return TrayState.SERVING
    if node.role == "coordinator":
        return TrayState.COORDINATOR
    return TrayState.AVAILABLE


def _until(ts: float | None, now: float) -> str:
    if ts is None:
        return " until you resume"
    return " until " + time.strftime("%H:%M", time.localtime(ts)) if ts > now else ""


def span(minutes: float) -> str:
    """A throttle setting's time in words: 0.5 -> '30 s', 2 -> '2 min', 90 -> '1.5 h'."""
    if minutes < 1:
        return f"{minutes * 60:.0f} s"
    if minutes < 60:
        return f"{minutes:g} min"
    return f"{minutes / 60:g} h"


def _idle(p: ThrottlePolicy | None) -> str:
    return f"after {span(p.idle_minutes)} idle" if p is not None else "once you leave it idle"


def explain(node: NodeStatus, now: float | None = None) -> str | None:
    """Why this laptop is paused or limited, and when that ends, in words, from the reason's kind
    and the throttle policy the agent runs with (None: it is neither). An older agent, which sends
    no kind, is explained in its own words."""
    now = time.time() if now is None else now
    state, reason, kind, p = node.state, node.reason, node.reason_kind, node.throttle_policy
    if state not in ("paused", "limited"):
        return None
    paused = state == "paused"
    if kind is PauseReason.SWITCH or (kind is None and reason == USER):
        return ("paused" if paused else "contributing less") + _until(node.paused_until, now)
    if kind is None or kind is PauseReason.OTHER:  # words only: an older agent's, or a newer kind
        return f"paused: {reason or 'unknown reason'}" if paused else "limited" + (f" ({reason})" if reason else "")
    what = reason or kind.value
    if kind is PauseReason.INPUT:
        if paused:
            return f"paused while you use this laptop; contributes again {_idle(p)}"
        return f"contributing less while you use this laptop; fully again {_idle(p)}"
    head = f"paused: {what}" if paused else f"contributing less: {what}"
    again = "contributes again" if paused else "fully again"
    if kind is PauseReason.HEAT:
        return f"{head}; {again} at {p.temp_low_c:.0f} °C or below" if p is not None else f"{head}; {again} once cool"
    if kind is PauseReason.BATTERY:
        return f"{head}; {again} when plugged in"
    if kind is PauseReason.LID:
        return f"{head}; {again} when the lid opens"
    if kind is PauseReason.SCHEDULE:
        hours = f" ({p.hours})" if p is not None and p.hours else ""
        return f"paused outside the hours set for contributing{hours}; {again} within them"
    if kind is PauseReason.LOAD:
        low = f"{p.cpu_low_pct:.0f}% CPU or less" if p is not None else "less CPU"
        return f"{head}; {again} once other programs use {low}"
    if kind is PauseReason.GPU:
        low = f"{p.gpu_low_pct:.0f}% of the GPU or less" if p is not None else "less of the GPU"
        return f"{head}; {again} once other programs use {low}"
    return head


def status_line(node: NodeStatus | None, error: str | None = None, now: float | None = None) -> str:
    """The menu's first line: 'serving layers 12-23 of qwen2.5-coder-1.5b, 3 peers'."""
    now = time.time() if now is None else now
    if error:
        return f"error: {error}"
    if node is None:
        return "starting the agent…"
    if waiting_for_cluster(node):
        failed = f" (last try: {node.error})" if node.error else ""
        return f"not in a cluster yet: create one or join one{failed}"
    peer_text = f"{node.peers} peer" + ("" if node.peers == 1 else "s")
    why = explain(node, now)
    if node.state == "paused":
        return f"{why}, {peer_text}"
    st = node.stage
    prefix = f"{why}, " if why else ""
    role = "coordinator, " if node.role == "coordinator" else ""
    if st.assigned and st.layers:
        a, b = st.layers
        model = st.model or "the model"
        return f"{prefix}{role}serving layers {a}-{b - 1} of {model}, {peer_text}"
    if not node.coordinator:
        return f"{prefix}no cluster yet (looking for peers), {peer_text}"
    return f"{prefix}{role}{'no stage' if prefix else 'idle'}, {peer_text}"


NOTICE_MS = 8000  # how long a notification stays on screen


@dataclass(frozen=True)
class Notice:
    """A notification: ``key`` names what it is about (a later notice with the same key replaces
    it on screen: the coordinator's follow-up replaces its loss); it goes after ``timeout_ms``."""

    title: str
    text: str
    key: str | None = None
    timeout_ms: int = NOTICE_MS


def notices(before: NodeStatus | None, after: NodeStatus | None) -> list[Notice]:
    """What changed on this laptop that its user should hear about."""
    if before is None or after is None:
        return []
    out = []
    was, now = (before.state, before.reason), (after.state, after.reason)
    # heat and battery are news; the user's own activity or switch is not (they know)
    if now != was and now[0] in ("paused", "limited") and reason_kind(after.reason, after.reason_kind) == "heat":
        kind = "paused" if now[0] == "paused" else "is contributing less"
        verb = "was paused" if now[0] == "paused" else kind
        why = now[1]
        out.append(Notice("lakeshard", f"This laptop {verb}: {why}. Its work moved to other laptops."))
    if was[0] == "paused" and now[0] == "available" and reason_kind(before.reason, before.reason_kind) == "heat":
        out.append(Notice("lakeshard", "This laptop contributes again."))
    return out


COORDINATOR = "coordinator"  # the key of notices about the coordinator
LOST_GRACE_S = 5.0  # a stream back within this long with the same coordinator: no loss to tell


def _name(node: str | None, names: dict[str, str]) -> str:
    return "" if node is None else names.get(node, node)


@dataclass
class CoordinatorWatch:
    """What the user hears about the cluster's coordinator, from the event stream's facts (pure).

    The relay on the local agent says ``coordinator_lost`` whenever its stream from the
    coordinator breaks; that alone is no news. A loss is told only once the stream has been without
    a coordinator for ``grace_s`` and the election (the agent's ``/v1/node``) does not name the
    same one either; a snapshot with another coordinator is told as a change; and once a
    coordinator answers again after a told loss, a follow-up says who ("carol-laptop coordinates
    now"), replacing the loss on screen. Call :meth:`on_event` for each event and :meth:`tick`
    every second or so."""

    grace_s: float = LOST_GRACE_S
    known: str | None = None  # the coordinator of the last snapshot
    lost_at: float | None = None  # when the stream said it lost the coordinator (None: not lost)
    told: bool = False  # whether that loss was told

    def on_event(self, ev: Event, names: dict[str, str], now: float) -> list[Notice]:
        if isinstance(ev, CoordinatorLost):
            if self.known is None:
                self.known = ev.coordinator
            if self.lost_at is None:
                self.lost_at = now
            return []
        if isinstance(ev, Snapshot):
            return self._snapshot(ev, {**names, **{n.node: n.name for n in ev.view.nodes}}, now)
        if isinstance(ev, Failover):
            name = _name(ev.lost, names)
            return [Notice("lakeshard", f"A laptop left mid-answer ({name}); answers carried on on the others.")]
        return []

    def _snapshot(self, ev: Snapshot, names: dict[str, str], now: float) -> list[Notice]:
        new, old = ev.view.coordinator, self.known
        if new is None:  # a view without a coordinator: as good as lost
            if self.lost_at is None and old is not None:
                self.lost_at = now
            return []
        out: list[Notice] = []
        who = _name(new, names)
        if self.told:
            again = "again" if new == old else "now"
            out.append(Notice("lakeshard", f"{who} coordinates the cluster {again}.", COORDINATOR))
        elif old is not None and new != old:
            text = f"The cluster has a new coordinator: {who} coordinates now (was {_name(old, names)})."
            out.append(Notice("lakeshard", text, COORDINATOR))
        self.known, self.lost_at, self.told = new, None, False
        return out

    def tick(self, now: float, elected: str | None, names: dict[str, str]) -> list[Notice]:
        """Tell a loss that lasted ``grace_s``, unless the election still names the same coordinator
        (``elected``: the local agent's view of it; then only the stream broke, not the coordinator)."""
        if self.lost_at is None or self.told or now - self.lost_at < self.grace_s:
            return []
        if elected is not None and elected == self.known:
            return []
        self.told = True
        who = f" ({_name(self.known, names)})" if self.known else ""
        return [Notice("lakeshard", f"The cluster lost its coordinator{who}; electing another…", COORDINATOR)]
