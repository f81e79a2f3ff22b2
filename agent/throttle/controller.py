"""This node's contribution state, and what it does about it.

Two inputs: the user's own switch (the tray's "Pause contributing", through the status API)
and the throttle policy over the probes (read every ``poll_s``). The stricter wins. Then:

* PAUSED: the stage refuses every new step (``paused``), so the coordinator moves its streams
  to the other nodes at once and replays them there; the beats and the mDNS advert say so, so
  the planner leaves the node out, and a coordinator steps down.
* LIMITED: the process drops to a lower priority, the compute thread rests in proportion to
  its work (it computes at most ``limited_share`` of the time) and no longer spins between
  steps, the next stage it compiles uses that share of the threads, and the planner counts the
  node at reduced speed.

The stage is told through one call (``StageHost.throttle``), never by writing its fields.
* AVAILABLE: all of that is undone (where the OS lets a process raise its priority again).

Resuming while the user is at the keyboard ("Resume contributing" in the tray, when the policy
pauses for input) is taken at its word: the node contributes at once, limited rather than paused,
until its user leaves the laptop for ``idle_minutes`` (then the policy runs as set again). A
change of the settings, or of the switch, applies at once: no dwell (it is the user's own act,
not a noisy sensor).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import psutil

from agent.protocol.status import PauseReason
from agent.throttle.policy import AVAILABLE, LIMITED, PAUSED, RANK, Clock, Decision, ThrottleSettings, decide
from agent.throttle.probes import Probes
from agent.throttle.readings import Readings

log = logging.getLogger(__name__)
USER = "user"  # the reason of the user's own pause
LOW_NICE = 10


def clock_now() -> Clock:
    t = time.localtime()
    return Clock(t.tm_wday, t.tm_hour * 60 + t.tm_min)


class Contribution:
    def __init__(
        self,
        me: Any,  # agent.cluster.elector.LocalNode: its state and reason are what beats and adverts carry
        stage: Callable[[str | None, float | None], None],  # agent.serving.stage_host.StageHost.throttle
        settings: Callable[[], ThrottleSettings],
        enabled: bool = True,
        poll_s: float = 0.1,
    ) -> None:
        self.me, self.stage, self.settings = me, stage, settings
        self.enabled = enabled
        self.poll_s = poll_s
        self.manual: str | None = None  # the user's switch: paused or limited (None: not set)
        self.manual_until: float | None = None  # wall clock: the switch resets then
        self.decision: Decision | None = None
        self.readings: Readings | None = None
        self.input_waived = False  # resumed while in use: limited, not paused, until its user leaves it
        self.probes: Probes | None = None
        self.changes = 0
        self._nice: int | None = None  # the priority before we lowered it
        self._applied: tuple[str, str | None] = (AVAILABLE, None)
        self._clock: Clock | None = None  # the last clock observe() was given (tests give their own)

    # -- inputs ----------------------------------------------------------------------------------
    def set_manual(self, state: str, for_s: float | None = None, now: float | None = None) -> None:
        """The user's switch: ``available`` clears it (and, while they use the laptop, lets it
        contribute limited until they leave it); ``for_s`` makes it end by itself. ``now``: the
        clock ``observe`` is given (default: the wall clock)."""
        self.manual = None if state == AVAILABLE else state
        self.manual_until = time.time() + for_s if for_s and self.manual else None
        if state == AVAILABLE and self.user_active():
            self.input_waived = True
        self.reconsider(now)

    def user_active(self) -> bool:
        """Whether the last readings say its user is at the laptop (input within ``idle_minutes``)."""
        r = self.readings
        s = self.settings()
        return r is not None and r.idle_s is not None and r.idle_s < s.idle_minutes * 60 and not r.locked

    def policy_settings(self) -> ThrottleSettings:
        """The settings the policy runs with: the file's, with a pause for input made a limit while waived."""
        s = self.settings()
        return replace(s, while_in_use="limit") if self.input_waived and s.while_in_use == "pause" else s

    def reconsider(self, now: float | None = None) -> None:
        """Decide again from the last readings, at once (the settings or the switch changed), and apply."""
        if self.readings is not None:
            clock = self._clock or clock_now()
            now = time.time() if now is None else now
            self.decision = decide(self.decision, self.readings, self.policy_settings(), now, clock, dwell=False)
        self.apply()

    def expire(self, now: float | None = None) -> None:
        """End a timed pause at its time (the policy then rules as set: no waiver, nobody resumed it)."""
        if self.manual_until is not None and (now or time.time()) >= self.manual_until:
            log.info("the pause asked for has ended")
            self.manual, self.manual_until = None, None
            self.reconsider(now)

    async def run(self) -> None:
        """Read the probes and follow the policy, until cancelled."""
        self.probes = await asyncio.to_thread(Probes)
        while True:
            try:
                r = await asyncio.to_thread(self.probes.read)
                self.observe(r, time.time())
            except Exception:
                log.exception("throttle probes failed")
            self.expire()
            await asyncio.sleep(self.poll_s)

    def observe(self, r: Readings, now: float, clock: Clock | None = None) -> None:
        self.readings = r
        self._clock = clock
        if self.input_waived and not self.user_active():
            self.input_waived = False  # its user left it: the next time they use it, the policy runs as set
        d = decide(self.decision, r, self.policy_settings(), now, clock or clock_now())
        if self.decision is None or (d.state, d.reason) != (self.decision.state, self.decision.reason):
            self.decision = d
            self.apply()
        else:
            self.decision = d

    # -- the outcome -----------------------------------------------------------------------------
    def effective(self) -> tuple[str, str | None, PauseReason | None]:
        """The state, its reason in words and its kind: the stricter of the switch and the policy."""
        auto = self.decision if self.enabled else None
        options: list[tuple[str, str | None, PauseReason | None]] = [(AVAILABLE, None, None)]
        if self.manual is not None:
            options.append((self.manual, USER, PauseReason.SWITCH))
        if auto is not None and auto.state != AVAILABLE:
            options.append((auto.state, auto.reason, PauseReason.from_cause(auto.cause) or PauseReason.OTHER))
        return max(options, key=lambda o: RANK[o[0]])  # the stricter; the user's on a tie

    def apply(self) -> None:
        state, reason, kind = self.effective()
        if (state, reason) == self._applied:
            return
        log.info("contribution %s -> %s%s", self._applied[0], state, f" ({reason})" if reason else "")
        self._applied = (state, reason)
        self.changes += 1
        self.me.state, self.me.reason = state, reason
        self.me.reason_kind = None if kind is None else kind.value  # beats and /v1/node carry it
        share = self.settings().limited_share
        # the stage's own method: it refuses steps while paused, rests and uses fewer threads while limited
        self.stage((reason or "paused") if state == PAUSED else None, share if state == LIMITED else None)
        if state == LIMITED:
            self._lower_priority()
        elif state == AVAILABLE:
            self._restore_priority()

    def _lower_priority(self) -> None:
        if self._nice is not None:
            return
        try:
            p = psutil.Process()
            self._nice = p.nice()
            if sys.platform == "win32":
                p.nice(psutil.BELOW_NORMAL_PRIORITY_CLASS)  # type: ignore[attr-defined,unused-ignore]
            else:
                p.nice(max(self._nice, LOW_NICE))
        except (psutil.Error, OSError) as e:
            log.info("cannot lower this process's priority: %s", e)

    def _restore_priority(self) -> None:
        if self._nice is None:
            return
        try:
            psutil.Process().nice(self._nice)
            self._nice = None
        except (psutil.Error, OSError) as e:  # POSIX: raising it again needs privileges
            log.info("priority stays lowered (%s)", e)
            self._nice = None

    def status(self) -> dict[str, Any]:
        d = self.decision
        return {
            "enabled": self.enabled,
            "policy": None if d is None else {"state": d.state, "reason": d.reason, "cause": d.cause, "since": d.since},
            "manual": self.manual,
            "manual_until": self.manual_until,
            "input_waived": self.input_waived,
            "readings": None if self.readings is None else self.readings.brief(),
            "sources": self.probes.sources() if self.probes is not None else {},
            "changes": self.changes,
        }
