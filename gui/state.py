"""What the tray shows, as pure functions of what the local agent and the coordinator say.

``tray_state`` picks the icon, ``status_line`` the menu's first line, ``notices`` the
notifications worth a user's attention. No Qt here: table tests cover every case.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from agent.protocol.events import CoordinatorLost, Event, Failover, Snapshot


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

NO_CLUSTER = "no_cluster"  # /v1/node's state while the agent waits for 'cluster init' or 'join'
HEAT_OR_BATTERY = ("heat", "hot", "temperature", "thermal", "battery", "power")


def waiting_for_cluster(node: dict[str, Any] | None) -> bool:
    """Whether the agent is in no cluster yet (the menu then offers to make or join one)."""
    return node is not None and node.get("state") == NO_CLUSTER


def holds_ca(node: dict[str, Any] | None) -> bool:
    """Whether this laptop holds its cluster's CA (it can invite laptops and revoke them)."""
    return node is not None and node.get("state") != NO_CLUSTER and bool(node.get("holds_ca"))


def reason_kind(reason: str | None) -> str:
    """'heat' for heat or battery reasons, 'user' for everything else a user causes, '' for none."""
    if not reason:
        return ""
    r = reason.lower()
    if any(w in r for w in HEAT_OR_BATTERY) or r.rstrip().endswith((" c", "°c")):
        return "heat"
    return "user"


def tray_state(node: dict[str, Any] | None, error: str | None = None) -> TrayState:
    """The icon for the local agent's ``/v1/node`` (None: it does not answer)."""
    if error:
        return TrayState.ERROR
    if node is None:
        return TrayState.NO_CLUSTER
    state = node.get("state")
    if state == NO_CLUSTER:
        return TrayState.NO_CLUSTER
    if state == "paused":
        return TrayState.PAUSED_HEAT if reason_kind(node.get("reason")) == "heat" else TrayState.PAUSED_USER
    if state == "limited":
        return TrayState.LIMITED
    if not node.get("coordinator"):
        return TrayState.NO_CLUSTER
    if (node.get("tok_s") or 0) > 0 and (node.get("stage") or {}).get("assigned"):
        return TrayState.SERVING
    if node.get("role") == "coordinator":
        return TrayState.COORDINATOR
    return TrayState.AVAILABLE


def _until(ts: float | None, now: float) -> str:
    if ts is None:
        return " until you resume"
    return " until " + time.strftime("%H:%M", time.localtime(ts)) if ts > now else ""


def status_line(node: dict[str, Any] | None, error: str | None = None, now: float | None = None) -> str:
    """The menu's first line: 'serving layers 12-23 of qwen2.5-coder-1.5b, 3 peers'."""
    now = time.time() if now is None else now
    if error:
        return f"error: {error}"
    if node is None:
        return "starting the agent…"
    if waiting_for_cluster(node):
        failed = f" (last try: {node['error']})" if node.get("error") else ""
        return f"not in a cluster yet: create one or join one{failed}"
    peers = int(node.get("peers") or 0)
    peer_text = f"{peers} peer" + ("" if peers == 1 else "s")
    state, reason = node.get("state"), node.get("reason")
    if state == "paused":
        if reason == "user":
            return f"paused{_until(node.get('paused_until'), now)}, {peer_text}"
        return f"paused: {reason or 'unknown reason'}, {peer_text}"
    st = node.get("stage") or {}
    prefix = "limited" + (f" ({reason})" if reason else "") + ", " if state == "limited" else ""
    role = "coordinator, " if node.get("role") == "coordinator" else ""
    if st.get("assigned") and st.get("layers"):
        a, b = st["layers"]
        model = st.get("model") or "the model"
        return f"{prefix}{role}serving layers {a}-{b - 1} of {model}, {peer_text}"
    if not node.get("coordinator"):
        return f"{prefix}no cluster yet (looking for peers), {peer_text}"
    return f"{prefix}{role}idle, {peer_text}"


@dataclass(frozen=True)
class Notice:
    title: str
    text: str


def notices(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[Notice]:
    """What changed on this laptop that its user should hear about."""
    if before is None or after is None:
        return []
    out = []
    was, now = (before.get("state"), before.get("reason")), (after.get("state"), after.get("reason"))
    # heat and battery are news; the user's own activity or switch is not (they know)
    if now != was and now[0] in ("paused", "limited") and reason_kind(now[1]) == "heat":
        kind = "paused" if now[0] == "paused" else "is contributing less"
        verb = "was paused" if now[0] == "paused" else kind
        why = now[1]
        out.append(Notice("lakeshard", f"This laptop {verb}: {why}. Its work moved to other laptops."))
    if was[0] == "paused" and now[0] == "available" and reason_kind(was[1]) == "heat":
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
