"""When a laptop contributes: the throttle policy over recorded traces, its settings, and the
probes (pure parsers, and the real ones on this machine)."""

from __future__ import annotations

import json
import random
from collections import namedtuple
from dataclasses import replace
from pathlib import Path

import pytest

from agent.common.config import ConfigError, load, parse
from agent.throttle.idle import IdleProbe, parse_ioreg, parse_mutter, windows_idle_ms
from agent.throttle.policy import AVAILABLE, LIMITED, PAUSED, Clock, Decision, ThrottleSettings, decide
from agent.throttle.power import lid_closed
from agent.throttle.probes import Probes, fake_readings
from agent.throttle.readings import Readings
from agent.throttle.thermal import hottest

S = ThrottleSettings(min_dwell_s=0.0)
IDLE = Readings(idle_s=3600.0, temp_c=50.0, on_battery=False, battery_pct=90.0, foreground_cpu=0.05)


def _d(
    state: str, reason: str | None = None, since: float = 0.0, cause: str = "", latches: tuple[str, ...] = ()
) -> Decision:
    return Decision(state, reason, since, cause, frozenset(latches))


@pytest.mark.parametrize(
    ("prev", "r", "s", "state", "reason"),
    [
        (None, IDLE, S, AVAILABLE, None),
        (None, Readings(), S, AVAILABLE, None),  # a machine that can say nothing contributes
        (None, replace(IDLE, idle_s=4.0), S, PAUSED, "user active"),
        (None, replace(IDLE, idle_s=119.0), S, PAUSED, "user active"),
        (None, replace(IDLE, idle_s=121.0), S, AVAILABLE, None),
        (None, replace(IDLE, idle_s=4.0, locked=True), S, AVAILABLE, None),  # locked: its user is away
        (None, replace(IDLE, idle_s=4.0), replace(S, while_in_use="limit"), LIMITED, "user active"),
        (None, replace(IDLE, idle_s=4.0), replace(S, while_in_use="run"), AVAILABLE, None),
        (None, replace(IDLE, temp_c=92.4), S, PAUSED, "92 C"),
        (None, replace(IDLE, temp_c=85.0), S, AVAILABLE, None),  # between the marks, not yet hot
        (_d(PAUSED, "92 C", cause="heat", latches=("heat",)), replace(IDLE, temp_c=85.0), S, PAUSED, "92 C"),
        (_d(PAUSED, "92 C", cause="heat", latches=("heat",)), replace(IDLE, temp_c=79.0), S, AVAILABLE, None),
        (None, replace(IDLE, on_battery=True), S, PAUSED, "on battery"),
        (None, replace(IDLE, on_battery=True), replace(S, on_battery="limit"), LIMITED, "on battery"),
        (None, replace(IDLE, on_battery=True), replace(S, on_battery="run"), AVAILABLE, None),
        (None, replace(IDLE, on_battery=True, battery_pct=18), replace(S, on_battery="run"), PAUSED, "battery at 18%"),
        (None, replace(IDLE, foreground_cpu=0.75), S, LIMITED, "other programs use 75% CPU"),
        (_d(LIMITED, "x", cause="load", latches=("load",)), replace(IDLE, foreground_cpu=0.4), S, LIMITED, "x"),
        (_d(LIMITED, "x", cause="load", latches=("load",)), replace(IDLE, foreground_cpu=0.2), S, AVAILABLE, None),
        (None, replace(IDLE, foreground_gpu=0.73), S, LIMITED, "other programs use 73% of the GPU"),
        (None, replace(IDLE, foreground_gpu=0.5), S, LIMITED, "other programs use 50% of the GPU"),
        (None, replace(IDLE, foreground_gpu=0.35), S, AVAILABLE, None),  # between the marks, not yet busy
        (_d(LIMITED, "x", cause="gpu", latches=("gpu",)), replace(IDLE, foreground_gpu=0.35), S, LIMITED, "x"),
        (_d(LIMITED, "x", cause="gpu", latches=("gpu",)), replace(IDLE, foreground_gpu=0.2), S, AVAILABLE, None),
        (_d(LIMITED, "x", cause="load", latches=("load",)), replace(IDLE, foreground_gpu=0.35), S, AVAILABLE, None),
        (None, replace(IDLE, foreground_gpu=1.0), replace(S, gpu_high=None), AVAILABLE, None),
        (None, replace(IDLE, foreground_gpu=0.9, temp_c=95.0), S, PAUSED, "95 C"),
        (None, replace(IDLE, lid_closed=True), S, PAUSED, "lid closed"),
        # the most important cause names it; the strictest state wins
        (None, replace(IDLE, idle_s=3.0, temp_c=95.0, foreground_cpu=0.9), S, PAUSED, "95 C"),
        (
            None,
            replace(IDLE, foreground_cpu=0.9, on_battery=True),
            replace(S, on_battery="limit"),
            LIMITED,
            "on battery",
        ),
        (None, replace(IDLE, idle_s=3.0, temp_c=95.0), replace(S, enabled=False), AVAILABLE, None),
    ],
)
def test_the_policy(prev: Decision | None, r: Readings, s: ThrottleSettings, state: str, reason: str | None) -> None:
    d = decide(prev, r, s, now=100.0)
    assert (d.state, d.reason) == (state, reason)


@pytest.mark.parametrize(
    ("hours", "days", "clock", "contributes"),
    [
        ((480, 1140), frozenset(range(7)), Clock(0, 600), True),
        ((480, 1140), frozenset(range(7)), Clock(0, 1140), False),
        ((1320, 360), frozenset(range(7)), Clock(2, 1400), True),  # 22:00-06:00 wraps midnight
        ((1320, 360), frozenset(range(7)), Clock(2, 300), True),
        ((1320, 360), frozenset(range(7)), Clock(2, 720), False),
        (None, frozenset(range(5)), Clock(5, 720), False),  # Saturday, weekdays only
        (None, frozenset(range(5)), Clock(4, 720), True),
    ],
)
def test_contribution_hours(
    hours: tuple[int, int] | None, days: frozenset[int], clock: Clock, contributes: bool
) -> None:
    d = decide(None, IDLE, replace(S, hours=hours, days=days), 0.0, clock)
    assert (d.state == AVAILABLE) is contributes
    if not contributes:
        assert d.reason == "outside the hours set for contributing"


def _run(trace: list[tuple[float, Readings]], s: ThrottleSettings) -> list[tuple[float, str, str | None]]:
    """The changes of state over a recorded trace of readings."""
    prev: Decision | None = None
    changes = []
    for t, r in trace:
        d = decide(prev, r, s, t)
        if prev is None or (d.state, d.reason) != (prev.state, prev.reason):
            changes.append((t, d.state, d.reason))
        prev = d
    return changes


def test_a_noisy_temperature_trace_does_not_flap() -> None:
    rng = random.Random(7)
    trace = []
    for i in range(600):  # ten minutes at 1 Hz: warming through the high mark, then cooling
        base = 70 + 25 * min(i, 300) / 300 - 25 * max(0, i - 360) / 240
        trace.append((float(i), replace(IDLE, temp_c=base + rng.uniform(-3, 3))))
    changes = _run(trace, ThrottleSettings())
    assert [c[1] for c in changes] == [AVAILABLE, PAUSED, AVAILABLE]
    t_hot, t_cool = changes[1][0], changes[2][0]
    assert trace[int(t_hot)][1].temp_c >= 90 and trace[int(t_cool)][1].temp_c <= 80  # type: ignore[operator]


def test_typing_pauses_at_once_and_idling_for_the_set_time_resumes() -> None:
    s = ThrottleSettings(idle_minutes=0.5, min_dwell_s=5.0)
    trace, last_input = [], -1000.0
    for k in range(0, 1000):  # 100 s at 10 Hz: typing at 20 s and at 25 s
        t = k / 10
        if t in (20.0, 25.0):
            last_input = t
        trace.append((t, replace(IDLE, idle_s=t - last_input)))
    changes = _run(trace, s)
    assert changes == [(0.0, AVAILABLE, None), (20.0, PAUSED, "user active"), (55.0, AVAILABLE, None)]


def test_a_state_is_kept_for_its_dwell_time_before_relaxing() -> None:
    s = ThrottleSettings(min_dwell_s=10.0)
    plug = [(float(t), replace(IDLE, on_battery=t in (5, 7))) for t in range(30)]  # unplugged twice, briefly
    changes = _run(plug, s)
    assert changes == [(0.0, AVAILABLE, None), (5.0, PAUSED, "on battery"), (15.0, AVAILABLE, None)]


def test_gpu_load_limits_at_once_and_relaxes_at_its_low_mark_after_the_dwell() -> None:
    s = ThrottleSettings(min_dwell_s=10.0)

    def gpu(t: int, drop_at: int) -> float:
        return 0.05 if t < 5 else 0.8 if t < 8 else 0.35 if t < drop_at else 0.1

    between = [(float(t), replace(IDLE, foreground_gpu=gpu(t, 25))) for t in range(40)]
    assert _run(between, s) == [  # the reason keeps its first reading while GPU load lasts
        (0.0, AVAILABLE, None),
        (5.0, LIMITED, "other programs use 80% of the GPU"),
        (25.0, AVAILABLE, None),
    ]
    brief = [(float(t), replace(IDLE, foreground_gpu=gpu(t, 8))) for t in range(40)]
    assert _run(brief, s) == [
        (0.0, AVAILABLE, None),
        (5.0, LIMITED, "other programs use 80% of the GPU"),
        (15.0, AVAILABLE, None),
    ]


@pytest.mark.parametrize(
    ("throttle", "message"),
    [
        ({"idle_minutes": -1}, "throttle.idle_minutes: -1 must be a number from 0 to 1440"),
        ({"temp_high_c": "hot"}, "throttle.temp_high_c: 'hot' must be a number from 30 to 130"),
        ({"temp_low_c": 95}, "throttle.temp_low_c: 95 must be below temp_high_c (90)"),
        ({"cpu_low_pct": 70}, "throttle.cpu_low_pct: 70 must be below cpu_high_pct (60)"),
        ({"cpu_high_pct": 0}, "throttle.cpu_high_pct: 0 must be a number from 1 to 100"),
        ({"gpu_low_pct": 50}, "throttle.gpu_low_pct: 50 must be below gpu_high_pct (50)"),
        ({"gpu_high_pct": 0}, "throttle.gpu_high_pct: 0 must be a number from 1 to 100"),
        ({"gpu_high_pct": "on"}, "throttle.gpu_high_pct: 'on' must be a number from 1 to 100"),
        ({"gpu_low_pct": -5, "gpu_high_pct": "off"}, "throttle.gpu_low_pct: -5 must be a number from 0 to 100"),
        ({"on_battery": "maybe"}, "throttle.on_battery: 'maybe' must be one of pause, limit, run"),
        ({"while_in_use": True}, "throttle.while_in_use: True must be one of pause, limit, run"),
        ({"hours": "9 to 5"}, "throttle.hours: '9 to 5' must look like 08:00-19:00"),
        ({"hours": "10:00-10:00"}, "throttle.hours: '10:00-10:00' is not a span of the day"),
        ({"days": ["monday", "funday"]}, "throttle.days: ['monday', 'funday'] must be a list of days like [mon, tue]"),
        ({"limited_share": 0}, "throttle.limited_share: 0 must be a number from 0.05 to 1"),
        ({"enabled": "yes"}, "throttle.enabled: must be true or false"),
        ({"idle": 5}, "throttle: unknown setting(s): idle"),
    ],
)
def test_a_bad_throttle_setting_is_one_line_naming_the_key(throttle: object, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse({"throttle": throttle})
    assert str(e.value) == message


def test_good_throttle_settings() -> None:
    t = parse({"throttle": {"hours": "22:00-06:00", "days": ["Mon", "fri"], "cpu_high_pct": 80, "on_battery": "run"}})
    assert t.throttle.hours == (1320, 360) and t.throttle.days == frozenset({0, 4})
    assert t.throttle.cpu_high == 0.8 and t.throttle.on_battery == "run"
    assert parse({}).throttle == ThrottleSettings()
    off = parse({"throttle": {"cpu_high_pct": "off"}}).throttle
    assert off.cpu_high is None
    assert decide(None, replace(IDLE, foreground_cpu=1.0), replace(off, min_dwell_s=0), 0.0).state == AVAILABLE


def test_gpu_throttle_settings_from_the_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("throttle:\n  gpu_high_pct: 70\n  gpu_low_pct: 40\n")
    t = load(cfg).throttle
    assert (t.gpu_high, t.gpu_low) == (0.7, 0.4)
    assert (t.cpu_high, t.cpu_low) == (0.6, 0.3)  # the CPU's marks are its own
    d = decide(None, replace(IDLE, foreground_gpu=0.6), replace(t, min_dwell_s=0), 0.0)
    assert (d.state, d.reason) == (AVAILABLE, None)  # below the raised mark
    defaults = parse({"throttle": {}}).throttle
    assert (defaults.gpu_high, defaults.gpu_low) == (0.5, 0.2)
    cfg.write_text("throttle:\n  gpu_high_pct: off\n")
    off = load(cfg).throttle
    assert off.gpu_high is None and off.cpu_high == 0.6
    assert decide(None, replace(IDLE, foreground_gpu=1.0), replace(off, min_dwell_s=0), 0.0).state == AVAILABLE


def test_probe_parsers() -> None:
    assert windows_idle_ms(5_000, 1_000) == 4_000
    assert windows_idle_ms(1_000, 2**32 - 3_000) == 4_000  # GetTickCount wrapped after 49.7 days
    assert parse_mutter("(uint64 12345,)\n") == 12.345
    assert parse_mutter("Error: no such object") is None
    assert parse_ioreg('    |   "HIDIdleTime" = 2500000000\n') == 2.5
    T = namedtuple("T", "label current high critical")
    zones = {"acpitz": [T("", 41.0, None, None)], "coretemp": [T("Core 0", 63.0, 90, 100), T("Core 1", 71.0, 90, 100)]}
    assert hottest(zones) == 71.0  # the processor's zone first
    assert hottest({"nvme": [T("", 45.0, None, None)]}) == 45.0
    assert hottest({}) is None


def test_lid_and_fake_readings(tmp_path: Path) -> None:
    lid = tmp_path / "lid"
    assert lid_closed(lid) is None
    (lid / "LID0").mkdir(parents=True)
    (lid / "LID0" / "state").write_text("state:      open\n")
    assert lid_closed(lid) is False
    (lid / "LID0" / "state").write_text("state:      closed\n")
    assert lid_closed(lid) is True
    fake = tmp_path / "sensors.json"
    fake.write_text(json.dumps({"temp_c": 95, "on_battery": True, "idle_s": "soon", "bogus": 1}))
    assert fake_readings(fake) == {"temp_c": 95.0, "on_battery": True}
    fake.write_text(json.dumps({"foreground_gpu": 0.8, "foreground_cpu": None}))
    assert fake_readings(fake) == {"foreground_gpu": 0.8, "foreground_cpu": None}
    fake.write_text(json.dumps({"foreground_gpu": True}))
    assert fake_readings(fake) == {}
    fake.write_text("{broken")
    assert fake_readings(fake) == {}


def test_a_sensors_file_stands_in_for_the_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "sensors.json"
    rest = {"idle_s": 3600, "temp_c": 50, "foreground_cpu": 0.0, "on_battery": False, "lid_closed": False}
    fake.write_text(json.dumps({"foreground_gpu": 0.73, **rest}))
    monkeypatch.setenv("LAKESHARD_FAKE_SENSORS", str(fake))
    r = Probes(slow_s=0.0).read()
    assert r.foreground_gpu == 0.73 and r.brief()["foreground_gpu"] == 0.73
    d = decide(None, r, S, 0.0)
    assert (d.state, d.reason) == (LIMITED, "other programs use 73% of the GPU")


def test_the_probes_on_this_machine_read_or_say_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAKESHARD_FAKE_SENSORS", raising=False)
    p = Probes(slow_s=0.0)
    for _ in range(3):
        r = p.read()
        for name, v in r.brief().items():
            assert v is None or isinstance(v, int | float | bool), name
        assert r.foreground_cpu is None or 0.0 <= r.foreground_cpu <= 1.0
        assert r.foreground_gpu is None or 0.0 <= r.foreground_gpu <= 1.0
        assert "foreground_gpu" in r.brief()
    monkeypatch.delenv("DISPLAY", raising=False)
    assert IdleProbe().read() is None or IdleProbe().read() >= 0  # type: ignore[operator]


def test_the_benchmarks_resume_time_is_the_end_of_the_longest_stall() -> None:
    from coordinator.bench.throttle import resume_after

    arrivals = [0.1, 0.2, 0.3, 1.0, 1.05, 3.5, 3.55, 3.6]  # input at 1.0; the stall ends at 3.5
    assert resume_after(arrivals, 1.0) == pytest.approx(2.5)
    assert resume_after([0.1, 0.2], 1.0) is None
