"""The stage compute thread spins for its next job only while jobs come close together."""

from __future__ import annotations

import asyncio
import time

import pytest

from agent.serving.compute import GAP_WINDOW, ComputeThread, spin_pays


@pytest.mark.parametrize(
    ("gaps", "spin_s", "spins"),
    [
        ([], 0.05, True),  # a stream just started: no history yet
        ([], 0.0, False),  # switched off (user active, on battery)
        ([0.004] * 8, 0.0, False),
        ([0.004] * 8, 0.05, True),  # a LAN ring: the next frame comes in a few ms
        ([0.0] * 8, 0.05, True),  # micro-batching: the next job was already queued
        ([0.2] * 8, 0.05, False),  # a 100 ms/hop WAN ring
        ([0.06, 0.07, 0.08], 0.05, False),  # a draft of K tokens between verify steps
        ([0.004, 0.004, 0.004, 0.3, 0.3], 0.05, True),  # mostly short, a few stalls
        ([0.004, 0.004, 0.3, 0.3, 0.3], 0.05, False),  # mostly stalls
        ([0.05], 0.05, True),  # exactly at the window
    ],
)
def test_spin_pays(gaps: list[float], spin_s: float, spins: bool) -> None:
    assert spin_pays(gaps, spin_s) is spins


def _job() -> float:
    return time.monotonic()


async def _feed(ct: ComputeThread, n: int, gap_s: float) -> float:
    """Submit ``n`` jobs, each ``gap_s`` after the previous one finished; the time spun."""
    spun0 = ct.spun_s
    for _ in range(n):
        await asyncio.wait_for(ct.async_run(_job), 5.0)
        await asyncio.sleep(gap_s)  # the scenario: the gap before the next frame comes
    # the thread spins after the last job too: let it run out before reading the counter. (A bounded
    # wait, kept: the thread tells nobody when its spin ends, and whether it spins at all is what
    # the test measures; spin_s is the code's own bound on it.)
    await asyncio.sleep(ct.spin_s + 0.05)
    return ct.spun_s - spun0


async def test_a_stage_stops_spinning_while_its_frames_come_far_apart_and_resumes_when_they_do_not() -> None:
    ct = ComputeThread(spin_s=0.03, name="test-compute")
    try:
        close = await _feed(ct, GAP_WINDOW, 0.005)
        assert close > 0.005 * (GAP_WINDOW - 1) * 0.5, close  # spun through the short gaps

        await _feed(ct, GAP_WINDOW // 2 + 1, 0.12)  # the median gap moves past the window
        far = await _feed(ct, GAP_WINDOW, 0.12)
        # no more 30 ms spins after each job: at most the wait for the first one to run out
        assert far < 0.03 * 2, far

        await _feed(ct, GAP_WINDOW // 2 + 1, 0.005)
        again = await _feed(ct, GAP_WINDOW, 0.005)
        assert again > 0.005 * (GAP_WINDOW - 1) * 0.5, again
    finally:
        ct.shutdown()


async def test_a_stage_set_not_to_spin_never_spins() -> None:
    ct = ComputeThread(spin_s=0.0, name="test-compute")
    try:
        assert await _feed(ct, GAP_WINDOW, 0.005) == 0.0
    finally:
        ct.shutdown()
