"""When this laptop contributes: a pure function from what the probes read to a state.

``decide(previous, readings, settings, now, clock)`` gives AVAILABLE, LIMITED or PAUSED with
the reason. Restricting is immediate (the moment the user types, the chassis is hot, the
laptop unplugs); relaxing waits: heat and foreground load (CPU, GPU) have separate high and
low marks, input must have stopped for ``idle_minutes``, and every state is kept at least
``min_dwell_s`` before a less restrictive one, so a node does not flap on a noisy sensor.
A reason's text is fixed while its cause lasts ("user active", "92 C"), so that adverts and
node maps change only when something does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from agent.throttle.readings import Readings

AVAILABLE, LIMITED, PAUSED = "available", "limited", "paused"
RANK = {AVAILABLE: 0, LIMITED: 1, PAUSED: 2}
MODES = ("pause", "limit", "run")
ALL_DAYS = frozenset(range(7))
LATCHED = ("heat", "load", "gpu")  # causes with a low mark: they hold until it is reached


@dataclass(frozen=True)
class ThrottleSettings:
    enabled: bool = True
    idle_minutes: float = 2.0  # no input for this long before contributing fully again
    while_in_use: str = "pause"  # what input within idle_minutes does: pause, limit or run
    temp_high_c: float = 90.0  # at or above: paused
    temp_low_c: float = 80.0  # once paused for heat, until at or below this
    on_battery: str = "pause"  # pause, limit or run
    battery_floor_pct: float = 30.0  # below this charge: paused, whatever on_battery says
    cpu_high: float | None = 0.6  # other programs' share of all cores: at or above, limited (None: never)
    cpu_low: float = 0.3  # once limited for load, until at or below this
    gpu_high: float | None = 0.5  # other programs' share of the busiest GPU engine: the same (None: never)
    gpu_low: float = 0.2  # once limited for it, until at or below this
    hours: tuple[int, int] | None = None  # minutes of the day [start, end) to contribute in (may wrap)
    days: frozenset[int] = ALL_DAYS  # weekdays to contribute on (0 = Monday)
    limited_share: float = 0.5  # the share of this node's speed it offers when limited
    min_dwell_s: float = 10.0  # a state is kept at least this long before a less restrictive one


@dataclass(frozen=True)
class Decision:
    state: str
    reason: str | None
    since: float  # when this state began
    cause: str = ""  # what the reason is about: lid, hours, battery, heat, user, load, gpu
    latches: frozenset[str] = field(default_factory=frozenset)  # causes held by their low marks


@dataclass(frozen=True)
class Clock:
    """The local weekday (0 = Monday) and minute of the day, for contribution hours."""

    weekday: int
    minute: int


def _in_hours(s: ThrottleSettings, clock: Clock | None) -> bool:
    if clock is None:
        return True
    if clock.weekday not in s.days:
        return False
    if s.hours is None:
        return True
    a, b = s.hours
    m = clock.minute
    return a <= m < b if a <= b else (m >= a or m < b)


def _wants(prev: Decision | None, r: Readings, s: ThrottleSettings, clock: Clock | None) -> list[tuple[str, str, str]]:
    """(state, cause, reason) for every cause that restricts now, most important first."""
    out: list[tuple[str, str, str]] = []
    latched = prev.latches if prev is not None else frozenset()
    if r.lid_closed:
        out.append((PAUSED, "lid", "lid closed"))
    if not _in_hours(s, clock):
        out.append((PAUSED, "hours", "outside the hours set for contributing"))
    if r.on_battery:
        pct = r.battery_pct
        if pct is not None and pct < s.battery_floor_pct:
            out.append((PAUSED, "battery", f"battery at {pct:.0f}%"))
        elif s.on_battery == "pause":
            out.append((PAUSED, "battery", "on battery"))
        elif s.on_battery == "limit":
            out.append((LIMITED, "battery", "on battery"))
    t = r.temp_c
    if t is not None and (t >= s.temp_high_c or ("heat" in latched and t > s.temp_low_c)):
        out.append((PAUSED, "heat", f"{t:.0f} C"))
    in_use = r.idle_s is not None and r.idle_s < s.idle_minutes * 60 and not r.locked  # locked: away
    if in_use and s.while_in_use != "run":
        out.append((PAUSED if s.while_in_use == "pause" else LIMITED, "user", "user active"))
    cpu = r.foreground_cpu
    if cpu is not None and s.cpu_high is not None and (cpu >= s.cpu_high or ("load" in latched and cpu > s.cpu_low)):
        out.append((LIMITED, "load", f"other programs use {cpu * 100:.0f}% CPU"))
    gpu = r.foreground_gpu
    if gpu is not None and s.gpu_high is not None and (gpu >= s.gpu_high or ("gpu" in latched and gpu > s.gpu_low)):
        out.append((LIMITED, "gpu", f"other programs use {gpu * 100:.0f}% of the GPU"))
    return out


def decide(
    prev: Decision | None,
    r: Readings,
    s: ThrottleSettings,
    now: float,
    clock: Clock | None = None,
    *,
    dwell: bool = True,
) -> Decision:
    """The state this node should be in now (pure). ``dwell=False``: relax at once, without
    waiting out ``min_dwell_s`` (the user changed a setting or resumed: no noisy sensor to ride out)."""
    if not s.enabled:
        wants: list[tuple[str, str, str]] = []
    else:
        wants = _wants(prev, r, s, clock)
    latches = frozenset(c for _, c, _ in wants if c in LATCHED)
    if wants:
        state = max((w[0] for w in wants), key=RANK.__getitem__)
        cause, reason = next((c, why) for st, c, why in wants if st == state)
    else:
        state, cause, reason = AVAILABLE, "", ""
    if dwell and prev is not None and RANK[state] < RANK[prev.state] and now - prev.since < s.min_dwell_s:
        return replace(prev, latches=prev.latches | latches)  # too soon to relax
    if prev is not None and prev.state == state:
        if prev.cause == cause:
            return replace(prev, latches=latches)  # the same reason, its text unchanged
        return Decision(state, reason or None, prev.since, cause, latches)
    return Decision(state, reason or None, now, cause, latches)
