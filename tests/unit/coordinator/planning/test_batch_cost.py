"""The batch curve: fitted from measured step times, and what it predicts for rings."""

from __future__ import annotations

import pytest

from coordinator.planning.batch_cost import fit_curve, ring_token_s, step_scale

# Measured on the 2-core VM (paged probe, Qwen2.5-Coder-0.5B INT4, one thread): one stream
# 14 tok/s, eight batched 31 tok/s, so a step of 8 rows took 3.6 times one of one row.
CURVE = ((1, 1.0), (2, 1.3), (8, 3.6))


@pytest.mark.parametrize(
    ("rows", "scale"),
    [
        (1, 1.0),
        (0.5, 1.0),
        (2, 1.3),
        (4, 1.3 * (3.6 / 1.3) ** 0.5),  # halfway between 2 and 8 on a log scale
        (8, 3.6),
        (16, 3.6 + 8 * (3.6 - 1.3) / 6),  # past the last point: the last segment's cost per row
    ],
)
def test_step_scale(rows: float, scale: float) -> None:
    assert step_scale(CURVE, rows) == pytest.approx(scale)


def test_without_a_curve_a_step_of_b_rows_costs_b_steps() -> None:
    assert step_scale((), 6) == 6 and step_scale(((1, 1.0),), 3) == 3


@pytest.mark.parametrize(
    ("stages", "curve"),
    [
        ([{1: 10.0, 2: 13.0, 8: 36.0}], ((1, 1.0), (2, 1.3), (8, 3.6))),
        # two stages, each scaled by its own one-row time, then averaged
        ([{1: 10.0, 4: 20.0, 8: 30.0}, {1: 20.0, 4: 48.0, 8: 60.0}], ((1, 1.0), (4, 2.2), (8, 3.0))),
        # noise that makes a bigger batch look cheaper is flattened
        ([{1: 10.0, 4: 25.0, 8: 24.0}], ((1, 1.0), (4, 2.5), (8, 2.5))),
        ([{1: 10.0, 8: 36.0}], None),  # one larger size is not a curve
        ([{2: 13.0, 8: 36.0, 16: 60.0}], None),  # no one-row steps to scale by
        ([], None),
    ],
)
def test_fit_curve(stages: list[dict[int, float]], curve: tuple[tuple[int, float], ...] | None) -> None:
    assert fit_curve(stages) == curve


def test_one_user_gains_nothing_from_a_second_stage() -> None:
    one = ring_token_s([0.02], 0.002, 1, CURVE)
    two = ring_token_s([0.01, 0.01], 0.002, 1, CURVE)
    assert one == pytest.approx(0.022) and two == pytest.approx(0.024)


def test_many_users_on_one_stage_ride_the_curve() -> None:
    # 8 users on one stage: one step of 8 rows (3.6 steps' time) gives 8 tokens
    assert ring_token_s([0.02], 0.0, 8, CURVE) == pytest.approx(0.02 * 3.6 / 8)


def test_where_batching_pays_less_a_second_stage_pays_more() -> None:
    """A flat curve (8 rows for the price of 1.2) leaves a split little to add at 8 users; a
    steep one (per-stream cost) makes two stages of half the layers worth nearly twice one."""
    flat, steep = ((1, 1.0), (4, 1.1), (8, 1.2)), ((1, 1.0), (4, 4.0), (8, 8.0))
    for curve, low, high in ((flat, 0.8, 1.2), (steep, 1.7, 2.0)):
        gain = ring_token_s([0.02], 0.001, 8, curve) / ring_token_s([0.01, 0.01], 0.001, 8, curve)
        assert low < gain < high, (curve, gain)
