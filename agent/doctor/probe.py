"""The facts ``lakeshard doctor`` judges, read from this machine (the judging is in :mod:`agent.doctor.report`).

Every probe catches its own failures: a probe that cannot run is a finding, never a traceback.
The mDNS round trip runs in a thread beside the others (it takes about a second).
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import socket
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from agent import version as lakeshard_version
from agent.common import ports
from agent.doctor.report import (
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
    check_version,
)

DOCTOR_SERVICE = "_lakeshard-dr._tcp.local."  # not the agents' service type: running agents never see it


def bind_error(host: str, port: int, kind: int) -> str | None:
    """Why ``port`` cannot be bound on ``host`` (None: it can), as the agent would bind it."""
    e = ports.bind_error(host, port, kind)
    return None if e is None else e.strerror or str(e)


def agent_answers(api_port: int, timeout: float = 1.0) -> bool:
    """Whether a lakeshard agent answers on this machine's status API port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{api_port}/v1/node", timeout=timeout) as r:
            return isinstance(json.loads(r.read()), dict)
    except (OSError, ValueError):
        return False


def mdns_probe(enabled: bool, static_peers: int, timeout_ms: int = 3000) -> MdnsState:
    """Advertise a throwaway service from one zeroconf socket and resolve it through another."""
    if not enabled:
        return MdnsState(enabled=False, static_peers=static_peers)
    try:
        from zeroconf import InterfaceChoice, IPVersion, ServiceInfo, Zeroconf

        from agent.cluster.discovery import local_addresses

        addrs = local_addresses() or ["127.0.0.1"]
        zcs = [Zeroconf(interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only) for _ in range(2)]
    except Exception as e:  # OSError mostly; zeroconf raises others for odd interfaces
        return MdnsState(static_peers=static_peers, socket_error=f"{type(e).__name__}: {e}")
    tag = f"doctor-{secrets.token_hex(4)}"
    info = ServiceInfo(
        DOCTOR_SERVICE,
        f"{tag}.{DOCTOR_SERVICE}",
        port=9,
        properties={"pid": str(os.getpid())},
        addresses=[socket.inet_aton(a) for a in addrs],
        server=f"{tag}.local.",
    )
    try:
        zcs[0].register_service(info, cooperating_responders=True)
        back = ServiceInfo(DOCTOR_SERVICE, info.name)
        ok = bool(back.request(zcs[1], timeout_ms)) and back.properties.get(b"pid") == str(os.getpid()).encode()
        zcs[0].unregister_service(info)
    except Exception:
        ok = False
    finally:
        for zc in zcs:
            zc.close()
    return MdnsState(static_peers=static_peers, round_trip=ok)


def gui_error() -> str | None:
    """Why the tray's Qt libraries do not load (None: they do)."""
    try:
        import qasync  # noqa: F401
        from PySide6 import QtGui  # noqa: F401
    except Exception as e:  # ImportError, or OSError from a missing system library
        return f"{type(e).__name__}: {e}"
    return None


def throttle_readings() -> tuple[dict[str, Any], str]:
    """The throttle probes' readings (two reads: the foreground load needs two samples)."""
    from agent.throttle.probes import Probes

    probes = Probes(slow_s=0.0)
    probes.read()
    time.sleep(0.3)
    r = probes.read()
    return asdict(r), probes.idle.source


def devices() -> tuple[dict[str, str], str | None]:
    try:
        from agent.runtime.device import device_names

        return device_names(), None
    except Exception as e:
        return {}, f"{type(e).__name__}: {e}"


def speed() -> tuple[dict[str, float], dict[str, str]]:
    """The capacity probe's scores (cached per device fingerprint, as the agent reads them)."""
    try:
        from agent.node.capacity import probe

        cap = probe()
    except Exception as e:
        return {}, {"probe": f"{type(e).__name__}: {e}"}
    return (
        {d.name: d.score for d in cap.devices if not d.error},
        {d.name: d.error for d in cap.devices if d.error},
    )


def gather(config: str | None, port: int | None, api_port: int | None) -> tuple[list[Check], str]:
    from agent.common.config import ConfigError, Settings, config_file, load

    version = lakeshard_version()
    path = Path(config) if config else None
    try:
        settings, settings_error = load(path), None
    except ConfigError as e:
        settings, settings_error = Settings(), str(e)
    data_port = settings.port if port is None else port
    api = settings.api_port if api_port is None else api_port
    with ThreadPoolExecutor(1) as pool:
        mdns = pool.submit(mdns_probe, settings.mdns, len(settings.static_peers))
        running = agent_answers(api)
        checks = [
            check_version(version, platform.python_version(), f"{platform.system()} {platform.machine()}"),
            check_settings(str(path or config_file()), settings_error),
            check_openvino(*devices()),
        ]
        import psutil

        vm = psutil.virtual_memory()
        checks.append(check_memory(int(vm.available), int(vm.total), settings.min_coordinator_memory))
        checks.append(check_speed(*speed()))
        host = settings.interface or "0.0.0.0"
        tcp = bind_error(host, data_port, socket.SOCK_STREAM) if data_port else None
        udp = bind_error(host, data_port, socket.SOCK_DGRAM) if data_port else None
        checks.append(check_port("data_port", PortState(data_port, tcp, udp, running)))
        api_err = bind_error("127.0.0.1", api, socket.SOCK_STREAM) if api else None
        checks.append(check_port("api_port", PortState(api, api_err, None, running)))
        checks.append(check_tray(sys.platform, os.environ, gui_error()))
        checks.append(check_throttle(*throttle_readings(), sys.platform, os.environ))
        checks.append(check_mdns(mdns.result()))
    checks.sort(key=lambda c: ORDER.index(c.name))
    return checks, version
