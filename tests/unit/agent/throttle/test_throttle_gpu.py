"""The GPU foreground-load probe: DRM fdinfo in a /proc tree laid out like the kernel's (this
machine has no GPU driver), the Windows counters' instance names, and the real /proc here."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from agent.throttle.gpu_load import GpuLoad, busiest, parse_fdinfo, windows_share

SEC = 1_000_000_000
IGPU, DGPU = "0000:00:02.0", "0000:03:00.0"


def i915(client: int, render: int, copy: int = 0, video: int = 0) -> str:
    """An i915 client's fdinfo, as the kernel writes it (ns of engine time; two video engines)."""
    return (
        f"pos:\t0\nflags:\t02100002\nmnt_id:\t26\nino:\t1083\n"
        f"drm-driver:\ti915\ndrm-pdev:\t{IGPU}\ndrm-client-id:\t{client}\n"
        f"drm-engine-render:\t{render} ns\ndrm-engine-copy:\t{copy} ns\n"
        f"drm-engine-video:\t{video} ns\ndrm-engine-capacity-video:\t2\ndrm-engine-video-enhance:\t0 ns\n"
    )


def xe(client: int, rcs: int, ccs: int, gpu_cycles: int) -> str:
    """An xe client's fdinfo: engine cycles against the GPU's own cycle count (four compute engines)."""
    return (
        f"pos:\t0\nflags:\t0100002\nmnt_id:\t26\nino:\t685\n"
        f"drm-driver:\txe\ndrm-client-id:\t{client}\ndrm-pdev:\t{DGPU}\n"
        f"drm-total-system:\t0\ndrm-resident-gtt:\t192 KiB\ndrm-total-vram0:\t23992 KiB\n"
        f"drm-cycles-rcs:\t{rcs}\ndrm-total-cycles-rcs:\t{gpu_cycles}\n"
        f"drm-cycles-bcs:\t0\ndrm-total-cycles-bcs:\t{gpu_cycles}\n"
        f"drm-cycles-ccs:\t{ccs}\ndrm-total-cycles-ccs:\t{gpu_cycles}\ndrm-engine-capacity-ccs:\t4\n"
    )


NOT_DRM = "pos:\t0\nflags:\t02\nmnt_id:\t15\nino:\t4242\n"


def put(proc: Path, pid: int, ppid: int, fds: dict[int, tuple[str, str | None]]) -> None:
    """A process in the fake tree: its stat, and fd -> (link target, fdinfo text or None: gone)."""
    d = proc / str(pid)
    (d / "fd").mkdir(parents=True, exist_ok=True)
    (d / "fdinfo").mkdir(exist_ok=True)
    (d / "stat").write_text(f"{pid} (a (strange) name) S {ppid} {pid} {pid} 0 -1 4194560\n")
    for fd, (target, info) in fds.items():
        link = d / "fd" / str(fd)
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target)
        if info is not None:
            (d / "fdinfo" / str(fd)).write_text(info)


class Clock:
    def __init__(self) -> None:
        self.ns = 10 * SEC

    def __call__(self) -> int:
        return self.ns


def tree(proc: Path, step: int) -> None:
    """The processes at read ``step`` (0, 1): counters advanced by a second's work in between."""
    me = os.getpid()
    render = "/dev/dri/renderD128"
    # a browser: one client open in two fds (counted once), a socket, and an old-style card fd
    put(
        proc,
        100,
        1,
        {
            3: (render, i915(7, SEC + step * 300_000_000, copy=step * 100_000_000, video=step * 800_000_000)),
            4: (render, i915(7, SEC + step * 300_000_000, copy=step * 100_000_000, video=step * 800_000_000)),
            5: ("socket:[1234]", NOT_DRM),
            6: ("/dev/dri/card0", NOT_DRM),
        },
    )
    put(proc, 200, 1, {9: (render, i915(9, 5 * SEC + step * 250_000_000))})  # a game: 0.3 + 0.25 of render
    put(proc, 300, 1, {3: ("/dev/dri/renderD129", xe(3, 10_000 + step * 400, 500 + step * 1200, 80_000 + step * 1000))})
    # this agent and its export worker keep the same GPU busy: not the user's load
    put(proc, me, 1, {11: (render, i915(20, step * 900_000_000))})
    put(proc, 4_000_001, me, {5: (render, i915(21, step * 900_000_000))})
    put(proc, 500, 1, {7: (render, None)})  # its fd closed between the listing and the read
    if step == 0:  # a process that exits between the two reads
        put(proc, 400, 1, {3: (render, i915(30, 0))})
    else:
        shutil.rmtree(proc / "400")
        put(proc, 600, 1, {3: (render, i915(31, 50 * SEC))})  # started since: no interval of its own yet
    (proc / "self").mkdir(exist_ok=True)
    (proc / "700").mkdir(exist_ok=True)  # a process whose fds it may not list (or that has gone)


def test_other_programs_share_of_the_busiest_engine(tmp_path: Path) -> None:
    clock = Clock()
    tree(tmp_path, 0)
    load = GpuLoad(tmp_path, clock=clock)
    assert load.read() is None  # no interval yet
    tree(tmp_path, 1)
    clock.ns += SEC
    # render on the iGPU: 0.3 s (the browser, once) + 0.25 s (the game) in 1 s; video 0.8 s over
    # two engines = 0.4; the xe GPU's rcs 400/1000 cycles = 0.4 and ccs 1200/1000 over four = 0.3
    assert load.read() == pytest.approx(0.55)
    assert set(load.clients()) == {(IGPU, "7"), (IGPU, "9"), (IGPU, "31"), (DGPU, "3")}
    clock.ns += SEC  # a second with nothing done
    assert load.read() == 0.0


def test_a_counter_read_lower_than_before_stays_at_its_previous_value(tmp_path: Path) -> None:
    clock = Clock()
    load = GpuLoad(tmp_path, clock=clock)
    for t, render in enumerate([2 * SEC, 1 * SEC, 2 * SEC + 600_000_000]):
        put(tmp_path, 100, 1, {3: ("/dev/dri/renderD128", i915(7, render))})
        clock.ns = (10 + t) * SEC
        share = load.read()
    assert share == pytest.approx(0.6)  # from the larger earlier reading, not from the dip


def test_no_drm_clients_is_none(tmp_path: Path) -> None:
    clock = Clock()
    put(tmp_path, 100, 1, {3: ("socket:[1]", NOT_DRM), 4: ("/dev/dri/card0", NOT_DRM)})
    put(tmp_path, os.getpid(), 1, {5: ("/dev/dri/renderD128", i915(1, 0))})  # only this agent uses the GPU
    load = GpuLoad(tmp_path, clock=clock)
    assert load.read() is None
    clock.ns += SEC
    assert load.read() is None
    assert GpuLoad(tmp_path / "no-proc").read() is None


def test_fdinfo_parser() -> None:
    c = parse_fdinfo(i915(7, 123, copy=4, video=10))
    assert c is not None and c.key == (IGPU, "7")
    assert dict(c.busy) == {"render": 123, "copy": 4, "video": 10, "video-enhance": 0}
    assert dict(c.capacity) == {"video": 2} and not c.total
    x = parse_fdinfo(xe(3, 10, 20, 1000))
    assert x is not None and x.key == (DGPU, "3")
    assert dict(x.busy) == {"rcs": 10, "bcs": 0, "ccs": 20} and dict(x.total) == {"rcs": 1000, "bcs": 1000, "ccs": 1000}
    assert parse_fdinfo(NOT_DRM) is None
    assert parse_fdinfo("drm-driver:\txe\ndrm-client-id:\t3\ndrm-total-vram0:\t1 KiB\n") is None  # no engine stats
    no_id = parse_fdinfo("drm-driver:\tamdgpu\ndrm-engine-gfx:\t5 ns\n", "42/7")
    assert no_id is not None and no_id.key == ("amdgpu", "42/7")


def test_busiest_is_pure_and_clamped() -> None:
    a, b = parse_fdinfo(i915(1, 0)), parse_fdinfo(i915(1, 3 * SEC))
    assert a is not None and b is not None
    assert busiest({a.key: a}, {b.key: b}, SEC) == 1.0  # more than the interval: clamped
    assert busiest({b.key: b}, {a.key: a}, SEC) == 0.0  # backwards: nothing
    assert busiest({}, {b.key: b}, SEC) == 0.0  # a new client


def test_windows_counter_instances() -> None:
    eng = "luid_0x00000000_0x0000D1E5_phys_0_eng_0_engtype_3D"
    items = [
        (f"pid_1200_{eng}", 30.0),
        (f"pid_1300_{eng}", 25.0),
        (f"pid_99_{eng}", 40.0),  # this agent
        ("pid_1300_luid_0x00000000_0x0000D1E5_phys_0_eng_3_engtype_VideoDecode", 45.0),
        ("_Total", 100.0),
    ]
    assert windows_share(items, {99}) == pytest.approx(0.55)
    assert windows_share(items[2:3], {99}) is None
    assert windows_share([(f"pid_1_{eng}", 250.0)], set()) == 1.0


def test_the_probe_on_this_machine_reads_or_says_none() -> None:
    load = GpuLoad()
    assert load.read() is None
    for _ in range(2):
        v = load.read()
        assert v is None or 0.0 <= v <= 1.0
    if sys.platform != "win32":  # the PDH path gives up quietly where there is no pdh.dll
        assert load._read_windows() is None and load._read_windows() is None
