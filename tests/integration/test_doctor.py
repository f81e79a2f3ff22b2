"""``lakeshard doctor`` and ``lakeshard --version``: the pure checks, table-driven, then the real
command on this machine (OpenVINO, sockets, mDNS and all)."""

from __future__ import annotations

import json
import socket
from importlib.metadata import version
from typing import Any

import pytest

import agent
from agent.doctor.report import (
    GIB,
    MIB,
    ORDER,
    Check,
    MdnsState,
    PortState,
    check_mdns,
    check_memory,
    check_openvino,
    check_port,
    check_settings,
    check_speed,
    check_throttle,
    check_tray,
    overall,
    render_table,
)
from tests.support.cli import run_cli

IN_USE = "Address already in use"
IDLE_READINGS: dict[str, Any] = {"idle_s": 3.0, "temp_c": None, "on_battery": False, "foreground_cpu": 0.1}


@pytest.mark.parametrize(
    ("check", "status", "in_detail", "in_fix"),
    [
        (check_port("data_port", PortState(7700)), "ok", "7700 free (TCP and UDP)", ""),
        (check_port("data_port", PortState(7700, tcp_error=IN_USE)), "fail", "7700 is taken", "--port"),
        (check_port("data_port", PortState(7700, udp_error=IN_USE)), "fail", "UDP", "--port"),
        (check_port("api_port", PortState(7701, tcp_error=IN_USE)), "fail", "7701", "--api-port 0"),
        # the port is ours: this machine's agent is running
        (check_port("data_port", PortState(7700, "in use", "in use", agent_running=True)), "ok", "running", ""),
        (check_tray("linux", {}, None), "warn", "no display", "systemctl --user enable --now lakeshard-agent"),
        (check_tray("linux", {"DISPLAY": ":0"}, None), "ok", "display :0", ""),
        (check_tray("linux", {"WAYLAND_DISPLAY": "wayland-0"}, None), "ok", "wayland-0", ""),
        (check_tray("win32", {}, None), "ok", "Qt loads", ""),
        (check_tray("linux", {"DISPLAY": ":0"}, "ImportError: libxcb-cursor.so.0"), "warn", "libxcb", "lakeshard[gui]"),
        (check_mdns(MdnsState(round_trip=True)), "ok", "came back", ""),
        (check_mdns(MdnsState(round_trip=False)), "warn", "blocked", "static_peers"),
        (check_mdns(MdnsState(socket_error="OSError: no interface")), "fail", "UDP 5353", "--static-peers"),
        (check_mdns(MdnsState(enabled=False, static_peers=2)), "ok", "2 static peer", ""),
        (check_mdns(MdnsState(enabled=False)), "warn", "finds nobody", "static_peers"),
        (check_memory(8 * GIB, 16 * GIB), "ok", "8.0 GB free of 16.0 GB", ""),
        (check_memory(1 * GIB, 16 * GIB), "warn", "will not coordinate", "close programs"),
        (check_memory(100 * MIB, 16 * GIB), "fail", "too little", "close programs"),
        (check_openvino({"CPU": "Intel(R) Core(TM) Ultra 7", "GPU.0": "Intel(R) Arc(TM) Graphics"}), "ok", "Arc", ""),
        (check_openvino({"CPU": "AMD EPYC"}), "ok", "no GPU listed", ""),
        (check_openvino({}, "ImportError: libopenvino.so"), "fail", "does not load", "reinstall"),
        (check_speed({"CPU": 42.0}, {}), "ok", "CPU 42.0 GFLOP/s", ""),
        (check_speed({"CPU": 42.0}, {"GPU.0": "RuntimeError: CL"}), "warn", "failed: GPU.0", "--device CPU"),
        (check_speed({}, {"CPU": "RuntimeError: x"}), "fail", "measured nothing", "reinstall"),
        (check_throttle(IDLE_READINGS, "XScreenSaver", "linux", {}), "ok", "idle time from XScreenSaver", ""),
        (check_throttle({**IDLE_READINGS, "idle_s": None}, "none", "linux", {"DISPLAY": ":0"}), "warn", "", "libxss1"),
        (check_throttle({"idle_s": None}, "none", "linux", {"WAYLAND_DISPLAY": "w"}), "warn", "no idle", "GNOME"),
        (check_throttle({"idle_s": None}, "none", "win32", {}), "warn", "no idle", "desktop session"),
        (check_settings("/x/config.yaml", "port: 'x' is not a port number"), "fail", "not a port", "/x/config.yaml"),
    ],
)
def test_checks(check: Check, status: str, in_detail: str, in_fix: str) -> None:
    assert check.status == status
    assert in_detail in check.detail
    assert in_fix in check.fix
    assert bool(check.fix) == (status != "ok")  # every problem comes with its fix, nothing else does


def test_throttle_lists_which_probes_work() -> None:
    c = check_throttle(IDLE_READINGS, "XScreenSaver", "linux", {})
    assert c.data["working"] == ["foreground_cpu", "idle_s", "on_battery"] and c.data["missing"] == ["temp_c"]


def test_overall_and_table() -> None:
    checks = [Check("version", "ok", "x"), Check("tray", "warn", "no display", "run the agent")]
    assert overall(checks) == "warn" and overall([*checks, Check("mdns", "fail", "y", "z")]) == "fail"
    table = render_table(checks, "9.9")
    assert "fix: run the agent" in table and table.splitlines()[-1] == "overall: warn (1 to look at)"


def test_version_is_the_package_metadata() -> None:
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"lakeshard {version('lakeshard')}"
    assert agent.__version__ == version("lakeshard")  # what agents advertise over mDNS, too


def test_doctor_on_this_machine_with_a_taken_port(tmp_path: Any) -> None:
    """The real command: every check reported, OpenVINO's CPU with its name, a taken port a fail."""
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        r = run_cli("doctor", "--json", "--port", str(port), "--api-port", "0", env={"LAKESHARD_HOME": str(tmp_path)})
    report = json.loads(r.stdout.strip().splitlines()[-1])
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == list(ORDER)
    assert all(c["status"] in ("ok", "warn", "fail") and c["detail"] for c in checks.values())
    assert checks["openvino"]["data"]["devices"]["CPU"]  # the full device name, e.g. "AMD EPYC"
    assert checks["openvino"]["data"]["devices"]["CPU"] in checks["openvino"]["detail"]
    assert checks["data_port"]["status"] == "fail" and "--port" in checks["data_port"]["fix"]
    assert checks["api_port"]["status"] == "ok"
    assert checks["speed"]["data"]["gflops"]["CPU"] > 0
    assert checks["memory"]["data"]["free"] > 0
    assert report["status"] == "fail" and r.returncode == 1  # a fail, and only a fail, sets the exit status
    assert report["version"] == version("lakeshard")
