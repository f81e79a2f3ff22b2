"""``lakeshard doctor``: what this laptop offers the cluster, and what to fix.

Each check is a pure function of facts gathered by :mod:`agent.doctor.probe`, returning a
:class:`Check` (``ok``, ``warn`` or ``fail``, one line of detail, and one line that fixes a
problem). The runner prints a table, or with ``--json`` one JSON object on the last line; the
exit status is 1 when a check fails, else 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["ok", "warn", "fail"]
GIB = 1024**3
MIB = 1024**2
LOW_MEMORY = 512 * MIB  # below this a stage of even the smallest model does not fit
HEADLESS_FIX = "run the headless agent instead: systemctl --user enable --now lakeshard-agent (or 'lakeshard agent')"
ORDER = ("version", "settings", "openvino", "memory", "speed", "data_port", "api_port", "mdns", "tray", "throttle")


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def check_version(version: str, python: str, platform: str) -> Check:
    return Check("version", "ok", f"lakeshard {version}, Python {python} on {platform}", data={"version": version})


def check_settings(path: str, error: str | None) -> Check:
    if error:
        return Check("settings", "fail", error, f"correct {path} (or move it away to use the defaults)")
    return Check("settings", "ok", path, data={"path": path})


def check_openvino(devices: Mapping[str, str], error: str | None = None) -> Check:
    """``devices``: OpenVINO's device ids -> full names."""
    data = {"devices": dict(devices)}
    if error:
        return Check("openvino", "fail", f"OpenVINO does not load: {error}", "reinstall lakeshard", data)
    if not devices:
        return Check("openvino", "fail", "OpenVINO lists no device", "reinstall lakeshard", data)
    listed = "; ".join(f"{d}: {n}" for d, n in devices.items())
    if not any(d.split(".")[0] == "GPU" for d in devices):
        return Check("openvino", "ok", f"{listed} (no GPU listed: stages run on the CPU)", data=data)
    return Check("openvino", "ok", listed, data=data)


def check_memory(free: int, total: int, coordinator_min: int = 2 * GIB) -> Check:
    data = {"free": free, "total": total}
    figures = f"{free / GIB:.1f} GB free of {total / GIB:.1f} GB"
    if free < LOW_MEMORY:
        return Check("memory", "fail", f"{figures}: too little for any stage", "close programs to free memory", data)
    if free < coordinator_min:
        return Check(
            "memory",
            "warn",
            f"{figures}: small stages only, and this laptop will not coordinate",
            "close programs to free memory (coordinators need "
            f"{coordinator_min / GIB:.1f} GB: election.min_coordinator_memory_gb)",
            data,
        )
    return Check("memory", "ok", figures, data=data)


def check_speed(scores: Mapping[str, float], errors: Mapping[str, str]) -> Check:
    """The capacity probe's GFLOP/s per device, and the devices whose benchmark failed."""
    data = {"gflops": {d: round(s, 1) for d, s in scores.items()}, "errors": dict(errors)}
    measured = ", ".join(f"{d} {s:.1f} GFLOP/s" for d, s in scores.items())
    if not scores:
        why = "; ".join(f"{d}: {e}" for d, e in errors.items()) or "no device to measure"
        return Check("speed", "fail", f"the speed probe measured nothing ({why})", "reinstall lakeshard", data)
    if errors:
        failed = "; ".join(f"{d}: {e}" for d, e in errors.items())
        return Check(
            "speed",
            "warn",
            f"{measured}; failed: {failed}",
            f"update the {', '.join(errors)} driver, or pin the agent to a device that works: --device CPU",
            data,
        )
    return Check("speed", "ok", measured, data=data)


@dataclass(frozen=True)
class PortState:
    port: int
    tcp_error: str | None = None  # why binding it failed (None: free)
    udp_error: str | None = None  # the data port only: peer beats are UDP
    agent_running: bool = False  # a lakeshard agent answers on this machine's status API


def check_port(name: Literal["data_port", "api_port"], st: PortState) -> Check:
    """The agent's data port (TCP and UDP, all interfaces) or its status API port (TCP, 127.0.0.1)."""
    what = "data port" if name == "data_port" else "status API port"
    protos = "TCP and UDP" if name == "data_port" else "TCP on 127.0.0.1"
    data = {"port": st.port, "tcp_error": st.tcp_error, "udp_error": st.udp_error, "agent": st.agent_running}
    errs = [f"{p} {e}" for p, e in (("TCP", st.tcp_error), ("UDP", st.udp_error)) if e]
    if not errs:
        free = "0: any free port" if st.port == 0 else f"{st.port} free"
        return Check(name, "ok", f"{free} ({protos})", data=data)
    if st.agent_running:
        return Check(name, "ok", f"{st.port} in use by this machine's running lakeshard agent", data=data)
    if name == "data_port":
        fix = "give the agent another --port (or 'port:' in config.yaml), or stop the program holding it"
    else:
        fix = "give the agent --api-port 0 (any free port) or another number (or 'api_port:' in config.yaml)"
    return Check(name, "fail", f"the {what} {st.port} is taken ({'; '.join(errs)})", fix, data)


@dataclass(frozen=True)
class MdnsState:
    enabled: bool = True  # discovery.mdns in the settings
    static_peers: int = 0
    socket_error: str | None = None  # opening the multicast socket failed
    round_trip: bool = False  # a test advertisement came back through multicast


def check_mdns(st: MdnsState) -> Check:
    data = asdict(st)
    if not st.enabled:
        if st.static_peers:
            return Check("mdns", "ok", f"off in the settings; {st.static_peers} static peer(s)", data=data)
        return Check(
            "mdns",
            "warn",
            "off in the settings and no static peers: this agent finds nobody",
            "list the other agents in config.yaml (discovery.static_peers), or set discovery.mdns: true",
            data,
        )
    if st.socket_error:
        return Check(
            "mdns",
            "fail",
            f"cannot open the mDNS multicast socket (UDP 5353): {st.socket_error}",
            "run the agent with --no-mdns --static-peers host:port,... (or fix the network interface)",
            data,
        )
    if not st.round_trip:
        return Check(
            "mdns",
            "warn",
            "a test advertisement did not come back: multicast is blocked here",
            "allow UDP 5353 in the firewall (sudo ufw allow lakeshard), or list peers in discovery.static_peers",
            data,
        )
    return Check("mdns", "ok", "multicast works (a test advertisement came back)", data=data)


def check_tray(platform: str, env: Mapping[str, str], gui_error: str | None) -> Check:
    """A tray needs a display session (Linux: DISPLAY or WAYLAND_DISPLAY) and the GUI extras."""
    display = (env.get("WAYLAND_DISPLAY") or env.get("DISPLAY")) if platform.startswith("linux") else "desktop"
    data = {"display": display or None, "gui_error": gui_error}
    if gui_error:
        return Check(
            "tray",
            "warn",
            f"the tray's Qt libraries do not load: {gui_error}",
            "pip install 'lakeshard[gui]' (Debian/Ubuntu: apt install libxcb-cursor0 libxkbcommon-x11-0), "
            f"or {HEADLESS_FIX.removeprefix('run ')}",
            data,
        )
    if not display:
        return Check("tray", "warn", "no display (neither DISPLAY nor WAYLAND_DISPLAY is set)", HEADLESS_FIX, data)
    return Check("tray", "ok", f"display {display}; Qt loads", data=data)


def idle_fix(platform: str, env: Mapping[str, str]) -> str:
    if platform.startswith("linux"):
        if env.get("WAYLAND_DISPLAY") and not env.get("DISPLAY"):
            return "on Wayland only GNOME's idle monitor is read: use GNOME, or an X11 session"
        return "install libXss (Debian/Ubuntu: apt install libxss1) and run in the desktop session"
    if platform == "darwin":
        return "ioreg must be on PATH (it is part of macOS)"
    return "run the agent in the user's desktop session, not as a service"


def check_throttle(readings: Mapping[str, Any], idle_source: str, platform: str, env: Mapping[str, str]) -> Check:
    """Which throttle probes return a value here (None: this machine cannot say)."""
    working = sorted(k for k, v in readings.items() if v is not None)
    missing = sorted(k for k, v in readings.items() if v is None)
    data = {"working": working, "missing": missing, "idle_source": idle_source}
    listed = f"reads {', '.join(working) or 'nothing'}" + (f"; not here: {', '.join(missing)}" if missing else "")
    if readings.get("idle_s") is None:
        return Check(
            "throttle",
            "warn",
            f"cannot tell when you use this laptop (no idle time); {listed}",
            idle_fix(platform, env),
            data,
        )
    return Check("throttle", "ok", f"idle time from {idle_source}; {listed}", data=data)


def overall(checks: Sequence[Check]) -> Status:
    statuses = {c.status for c in checks}
    return "fail" if "fail" in statuses else "warn" if "warn" in statuses else "ok"


def render_table(checks: Sequence[Check], version: str) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"lakeshard {version}: what this laptop offers", f"{'CHECK':<{width}}  STATUS  DETAIL"]
    for c in checks:
        lines.append(f"{c.name:<{width}}  {c.status:<6}  {c.detail}")
        if c.fix and c.status != "ok":
            lines.append(f"{'':<{width}}  {'':<6}  fix: {c.fix}")
    s = overall(checks)
    problems = sum(c.status != "ok" for c in checks)
    lines.append(f"overall: {s}" + (f" ({problems} to look at)" if problems else ""))
    return "\n".join(lines)


def to_json(checks: Sequence[Check], version: str) -> str:
    return json.dumps({"version": version, "status": overall(checks), "checks": [asdict(c) for c in checks]})
