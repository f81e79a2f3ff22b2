"""Start the tray at login, per platform: XDG autostart (Linux), HKCU Run (Windows), a
LaunchAgent (macOS). What each writes is a pure function of the command; ``set_enabled``
writes or removes it. On Linux a system-wide entry (the .deb's /etc/xdg/autostart one) is
turned off for this user by a ``Hidden=true`` entry of the same name, as XDG says."""

from __future__ import annotations

import contextlib
import importlib
import os
import plistlib
import shlex
import sys
from pathlib import Path
from typing import Any

APP_ID = "io.lakeshard.tray"
RUN_VALUE = "lakeshard"


def tray_command() -> list[str]:
    """The command that starts the tray the way this copy of lakeshard is installed."""
    return [sys.executable, "-m", "agent", "tray"]


def desktop_entry(cmd: list[str]) -> str:
    return (
        "[Desktop Entry]\n"
        "Type=Application\n"
        "Name=lakeshard\n"
        "Comment=Share this laptop's idle capacity with the office's LLM cluster\n"
        f"Exec={shlex.join(cmd)}\n"
        "Icon=lakeshard\n"
        "Terminal=false\n"
        "Categories=Utility;Network;\n"
        "X-GNOME-Autostart-enabled=true\n"
    )


def launch_agent_plist(cmd: list[str]) -> bytes:
    return plistlib.dumps(
        {"Label": APP_ID, "ProgramArguments": cmd, "RunAtLoad": True, "KeepAlive": False, "ProcessType": "Interactive"}
    )


def windows_run_value(cmd: list[str]) -> str:
    import subprocess

    return subprocess.list2cmdline(cmd)


def xdg_autostart_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "autostart" / "lakeshard.desktop"


def system_autostart_files() -> list[Path]:
    """System-wide XDG autostart entries for the tray (the Linux package installs one)."""
    dirs = os.environ.get("XDG_CONFIG_DIRS") or "/etc/xdg"
    return [f for d in dirs.split(":") if d and (f := Path(d) / "autostart" / "lakeshard.desktop").is_file()]


def _hidden(f: Path) -> bool:
    try:
        return any(line.strip().lower() == "hidden=true" for line in f.read_text(encoding="utf-8").splitlines())
    except OSError:
        return False


def launch_agent_file() -> Path:
    return Path.home() / "Library" / "LaunchAgents" / f"{APP_ID}.plist"


def is_enabled(platform: str = sys.platform) -> bool:
    if platform == "win32":
        winreg: Any = importlib.import_module("winreg")
        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, r"Software\Microsoft\Windows\CurrentVersion\Run") as k:
                winreg.QueryValueEx(k, RUN_VALUE)
            return True
        except OSError:
            return False
    if platform == "darwin":
        return launch_agent_file().is_file()
    f = xdg_autostart_file()  # the user's entry overrides a system-wide one of the same name
    return not _hidden(f) if f.is_file() else bool(system_autostart_files())


def set_enabled(on: bool, cmd: list[str] | None = None, platform: str = sys.platform) -> str:
    """Turn start-at-login on or off; returns where it is recorded."""
    cmd = cmd or tray_command()
    if platform == "win32":
        winreg: Any = importlib.import_module("winreg")
        path = r"Software\Microsoft\Windows\CurrentVersion\Run"
        with winreg.OpenKey(winreg.HKEY_CURRENT_USER, path, 0, winreg.KEY_SET_VALUE) as k:
            if on:
                winreg.SetValueEx(k, RUN_VALUE, 0, winreg.REG_SZ, windows_run_value(cmd))
            else:
                with contextlib.suppress(FileNotFoundError):
                    winreg.DeleteValue(k, RUN_VALUE)
        return rf"HKCU\{path}\{RUN_VALUE}"
    f = launch_agent_file() if platform == "darwin" else xdg_autostart_file()
    if on:
        f.parent.mkdir(parents=True, exist_ok=True)
        if platform == "darwin":
            f.write_bytes(launch_agent_plist(cmd))
        else:
            f.write_text(desktop_entry(cmd), encoding="utf-8")
    elif platform != "darwin" and system_autostart_files():
        # a system-wide entry (the package's) starts the tray for everyone: hide it for this user
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(desktop_entry(cmd) + "Hidden=true\n", encoding="utf-8")
    else:
        f.unlink(missing_ok=True)
    return str(f)
