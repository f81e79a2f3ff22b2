"""What the tray shows, as pure functions of what the local agent and the coordinator say.

``tray_state`` picks the icon, ``status_line`` the menu's first line, ``notices`` the
notifications worth a user's attention. They read the agent's typed ``/v1/node``
(:class:`NodeStatus`): why it is paused comes from its ``reason_kind``, and only from the words of
its ``reason`` for an agent too old to send one. No Qt here: table tests cover every case.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from agent.protocol.events import CoordinatorLost, Event, Failover, Snapshot
from agent.protocol.status import NO_CLUSTER, NodeStatus, PauseReason


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
    state, reason = node.state, node.reason
    if state == "paused":
        if paused_by_user(node):
            return f"paused{_until(node.paused_until, now)}, {peer_text}"
        return f"paused: {reason or 'unknown reason'}, {peer_text}"
    st = node.stage
    prefix = "limited" + (f" ({reason})" if reason else "") + ", " if state == "limited" else ""
    role = "coordinator, " if node.role == "coordinator" else ""
    if st.assigned and st.layers:
        a, b = st.layers
        model = st.model or "the model"
        return f"{prefix}{role}serving layers {a}-{b - 1} of {model}, {peer_text}"
    if not node.coordinator:
        return f"{prefix}no cluster yet (looking for peers), {peer_text}"
    return f"{prefix}{role}idle, {peer_text}"


@dataclass(frozen=True)
class Notice:
    title: str
    text: str


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


def cluster_notices(last_coordinator: str | None, ev: Event, names: dict[str, str]) -> list[Notice]:
    """Cluster events worth a notification: the coordinator lost or replaced, a failover.

    ``last_coordinator``: the coordinator known before ``ev`` (kept across a loss);
    ``names``: node id -> host name, for the text."""
    if isinstance(ev, CoordinatorLost):
        if last_coordinator is None:
            return []
        name = names.get(last_coordinator, last_coordinator)
        return [Notice("lakeshard", f"The cluster lost its coordinator ({name}); electing another…")]
    if isinstance(ev, Snapshot):
        new = ev.view.coordinator
        if new is not None and last_coordinator is not None and new != last_coordinator:
            n = ev.view.node(new)
            return [Notice("lakeshard", f"The cluster elected a new coordinator: {n.name if n else new}.")]
    if isinstance(ev, Failover):
        name = names.get(ev.lost, ev.lost)
        return [Notice("lakeshard", f"A laptop left mid-answer ({name}); answers carried on on the others.")]
    return []
