"""The installers: a real .deb installed into a throwaway dpkg root, the Windows installers
compiled, the macOS LaunchAgent agreeing with the tray's own.

The .deb is built with ``--python-env`` (only the lakeshard wheel in its venv, the rest from this
test's own environment): the release payload (torch, OpenVINO) is too large to build in a test.
The Windows installers are compiled from a small stand-in payload folder, since the real payload
needs Windows wheels (make-payload.ps1 on Windows); the test checks what the installers carry and
do, not the Python inside. Each part skips, saying why, where its tools are missing.
"""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from gui.autostart import APP_ID, RUN_VALUE, launch_agent_plist

REPO = Path(__file__).resolve().parents[2]
INSTALLERS = REPO / "installers"


def need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install dpkg-dev nsis wixl msitools p7zip-full)")


def run(*cmd: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120) -> str:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def dpkg(root: Path, *args: str | Path) -> str:
    """dpkg on the throwaway root only: its own database, maintainer scripts told DPKG_ROOT."""
    return run("dpkg", f"--root={root}", "--force-script-chrootless", "--force-not-root", *args)


def test_deb_installs_runs_and_purges_clean(tmp_path: Path) -> None:
    need("dpkg-deb", "dpkg")
    out = run(INSTALLERS / "linux" / "build-deb", "--python-env", sys.prefix, "--out", tmp_path / "dist")
    deb = Path(out.strip().splitlines()[-1])
    assert deb.name == f"lakeshard_{version('lakeshard')}_{run('dpkg', '--print-architecture').strip()}.deb"
    fields = run("dpkg-deb", "--field", deb, "Package", "Depends")
    assert "Package: lakeshard" in fields and "python3." in fields

    root = tmp_path / "root"
    for d in ("var/lib/dpkg/info", "var/lib/dpkg/updates", "var/lib/dpkg/triggers"):
        (root / d).mkdir(parents=True)
    (root / "var/lib/dpkg/status").touch()
    # a user who enabled the headless agent, had the tray write its autostart entry, and has data
    home = root / "home" / "alice"
    wants = home / ".config/systemd/user/default.target.wants"
    wants.mkdir(parents=True)
    (wants / "lakeshard-agent.service").symlink_to("/usr/lib/systemd/user/lakeshard-agent.service")
    (home / ".config/autostart").mkdir(parents=True)
    tray_entry = home / ".config/autostart/lakeshard.desktop"
    tray_entry.write_text("[Desktop Entry]\nExec=/opt/lakeshard/venv/bin/python -m agent tray\n")
    user_settings = home / ".config/lakeshard/config.yaml"
    user_settings.parent.mkdir(parents=True)
    user_settings.write_text("cluster_id: office\n")

    dpkg(root, "--force-depends", "-i", deb)
    assert "ii  lakeshard" in dpkg(root, "-l", "lakeshard")
    venv = root / "opt/lakeshard/venv"
    link = root / "usr/bin/lakeshard"
    assert os.readlink(link) == "/opt/lakeshard/venv/bin/lakeshard"
    script = venv / "bin/lakeshard"
    assert script.read_text().splitlines()[0] == "#!/opt/lakeshard/venv/bin/python"  # not the build folder

    # the installed program, run from the installed tree (its venv's interpreter; /opt is not the real one)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(LAKESHARD_HOME=str(tmp_path / "home"), PYTHONWARNINGS="ignore")
    py = venv / "bin/python"
    where = run(py, "-c", "import agent; print(agent.__file__)", env=env, cwd=tmp_path)
    assert where.startswith(str(venv)), where
    assert run(py, script, "--version", env=env, cwd=tmp_path).strip() == f"lakeshard {version('lakeshard')}"
    r = subprocess.run(
        [str(py), str(script), "doctor", "--json", "--port", "0", "--api-port", "0"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == (1 if report["status"] == "fail" else 0)
    assert "CPU" in next(c for c in report["checks"] if c["name"] == "openvino")["data"]["devices"]

    unit = (root / "usr/lib/systemd/user/lakeshard-agent.service").read_text()
    assert "ExecStart=/usr/bin/lakeshard agent" in unit and "WantedBy=default.target" in unit
    for entry in (root / "etc/xdg/autostart/lakeshard.desktop", root / "usr/share/applications/lakeshard.desktop"):
        text = entry.read_text()
        assert "Exec=lakeshard tray" in text and "Icon=lakeshard" in text
    assert (root / "usr/share/icons/hicolor/scalable/apps/lakeshard.svg").is_file()
    assert "ports=7700/tcp|7700/udp|7702/tcp|5353/udp" in (root / "etc/ufw/applications.d/lakeshard").read_text()

    # byte-code Python writes beside the package's files (as root, or compileall) goes on removal too
    run(py, "-m", "compileall", "-q", venv / "lib", env=env, cwd=tmp_path)
    assert any(venv.rglob("__pycache__"))
    dpkg(root, "-r", "lakeshard")
    assert not (root / "opt/lakeshard").exists() and not link.is_symlink()
    assert (root / "etc/xdg/autostart/lakeshard.desktop").exists()  # a conffile: kept until purge
    dpkg(root, "-P", "lakeshard")
    leftovers = [
        root / "opt/lakeshard",
        root / "usr/lib/systemd/user/lakeshard-agent.service",
        root / "etc/xdg/autostart/lakeshard.desktop",
        root / "usr/share/applications/lakeshard.desktop",
        wants / "lakeshard-agent.service",
        tray_entry,
    ]
    assert [p for p in leftovers if p.exists() or p.is_symlink()] == []
    assert "lakeshard" not in dpkg(root, "-l")
    assert user_settings.read_text() == "cluster_id: office\n"  # user data stays unless asked


@pytest.fixture
def stand_in_payload(tmp_path: Path) -> Path:
    """A tiny file tree laid out like make-payload.ps1's folder (the real one needs Windows wheels)."""
    p = tmp_path / "payload"
    files = {
        "python/python.exe": b"MZ stand-in",
        "python/pythonw.exe": b"MZ stand-in",
        "python/python311._pth": b"python311.zip\r\n.\r\nLib\\site-packages\r\nimport site\r\n",
        "python/Lib/site-packages/agent/__init__.py": b"__version__ = '0'\n",
        "python/Lib/site-packages/gui/tray.py": b"",
    }
    for name, data in files.items():
        (p / name).parent.mkdir(parents=True, exist_ok=True)
        (p / name).write_bytes(data)
    return p


def test_windows_installers_compile_with_the_payload_and_the_hooks(tmp_path: Path, stand_in_payload: Path) -> None:
    need("makensis", "wixl", "wixl-heat", "msiinfo")
    out = run(INSTALLERS / "windows" / "build", "--payload", stand_in_payload, "--out", tmp_path / "dist")
    exe, msi = (Path(x) for x in out.split())
    v = version("lakeshard")
    assert (exe.name, msi.name) == (f"lakeshard-{v}-setup.exe", f"lakeshard-{v}.msi")
    head = exe.read_bytes()
    assert head[:2] == b"MZ" and b"NullsoftInst" in head  # a Windows program carrying an NSIS archive

    if shutil.which("7z"):
        listing = run("7z", "l", exe)
        for f in ("python/python.exe", "python/pythonw.exe", "python/Lib/site-packages/agent/__init__.py",
                  "lakeshard.cmd", "firewall.cmd", "lakeshard.ico", "uninstall.exe"):  # fmt: skip
            assert f in listing, f"{f} not in the NSIS installer:\n{listing}"
    nsi = (INSTALLERS / "windows" / "lakeshard.nsi").read_text()
    assert 'InstallDir "$LOCALAPPDATA\\Programs\\lakeshard"' in nsi and "RequestExecutionLevel user" in nsi
    # autostart is the tray's own Run value (gui/autostart.py), and the uninstaller removes it
    assert f'WriteRegStr HKCU "${{RUNKEY}}" "{RUN_VALUE}"' in nsi
    assert f'DeleteRegValue HKCU "${{RUNKEY}}" "{RUN_VALUE}"' in nsi
    assert 'firewall.cmd" add' in nsi and 'firewall.cmd" remove' in nsi

    files = run("msiinfo", "export", msi, "File")
    for f in ("python.exe", "pythonw.exe", "python311._pth", "__init__.py", "tray.py", "lakeshard.cmd", "firewall.cmd"):
        assert f"\t{f}\t" in files, f"{f} not in the MSI:\n{files}"
    dirs = run("msiinfo", "export", msi, "Directory")
    assert "INSTALLDIR\tProgramFiles64Folder\tlakeshard" in dirs
    registry = run("msiinfo", "export", msi, "Registry")
    tray = '"[INSTALLDIR]python\\pythonw.exe" -m agent tray'
    assert f"Software\\Microsoft\\Windows\\CurrentVersion\\Run\t{RUN_VALUE}\t{tray}" in registry
    assert "\t2\tSoftware\\Microsoft\\Windows\\CurrentVersion\\Run" in registry  # HKLM: per machine
    props = run("msiinfo", "export", msi, "Property")
    assert "ALLUSERS\t1" in props and f"ProductVersion\t{v}" in props
    shortcuts = run("msiinfo", "export", msi, "Shortcut")
    assert "-m agent tray" in shortcuts and 'lakeshard.cmd" doctor' in shortcuts
    actions = run("msiinfo", "export", msi, "CustomAction")
    assert 'firewall.cmd" add' in actions and 'firewall.cmd" remove' in actions
    seq = dict(
        line.split("\t")[::2] for line in run("msiinfo", "export", msi, "InstallExecuteSequence").splitlines()[3:]
    )
    # deferred actions sit inside the install script; the rule goes before its file does
    assert int(seq["InstallInitialize"]) < int(seq["FirewallRemove"]) < int(seq["RemoveFiles"])
    assert int(seq["InstallFiles"]) < int(seq["FirewallAdd"]) < int(seq["InstallFinalize"])
    assert int(seq["SetCmdExe"]) < int(seq["FirewallRemove"])


def test_windows_build_refuses_a_folder_that_is_no_payload(tmp_path: Path) -> None:
    build = INSTALLERS / "windows" / "build"
    r = subprocess.run([str(build), "--payload", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "no python/python.exe: not a payload folder" in r.stderr


def test_macos_launch_agents_match_the_tray_setting() -> None:
    """The shipped tray LaunchAgent is what the tray's "Start at login" writes, so it can turn it off."""
    tray = plistlib.loads((INSTALLERS / "macos" / f"{APP_ID}.plist").read_bytes())
    assert tray == plistlib.loads(launch_agent_plist(["/opt/lakeshard/venv/bin/python", "-m", "agent", "tray"]))
    agent = plistlib.loads((INSTALLERS / "macos" / "io.lakeshard.agent.plist").read_bytes())
    assert agent["ProgramArguments"] == ["/opt/lakeshard/venv/bin/python", "-m", "agent", "agent"]
    assert agent["RunAtLoad"] is True and agent["Label"] != tray["Label"]
    assert (REPO / "assets" / "icons" / "lakeshard.icns").read_bytes()[:4] == b"icns"


def test_the_tray_setting_turns_the_packages_autostart_off_and_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The .deb starts the tray for everyone (/etc/xdg/autostart); one user's "Start at login"
    switch must still turn it off for them (a Hidden=true entry of the same name) and on again."""
    from gui import autostart

    system = tmp_path / "etc-xdg"
    (system / "autostart").mkdir(parents=True)
    shutil.copy(INSTALLERS / "linux" / "lakeshard-autostart.desktop", system / "autostart" / "lakeshard.desktop")
    monkeypatch.setenv("XDG_CONFIG_DIRS", f"{tmp_path / 'none'}:{system}")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    cmd = ["/opt/lakeshard/venv/bin/python", "-m", "agent", "tray"]
    assert autostart.is_enabled("linux")  # the package's entry alone
    autostart.set_enabled(False, cmd, platform="linux")
    user = tmp_path / "cfg" / "autostart" / "lakeshard.desktop"
    assert "Hidden=true" in user.read_text() and not autostart.is_enabled("linux")
    autostart.set_enabled(True, cmd, platform="linux")
    assert "Hidden" not in user.read_text() and autostart.is_enabled("linux")
