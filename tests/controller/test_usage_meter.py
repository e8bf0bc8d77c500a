"""`UsageMeter` with plain numbers: exact half-life decay, adding, the value before any request,
times that go backwards, and validation."""

from __future__ import annotations

import math

import pytest

from controller.usage_meter import UsageMeter


def test_nothing_counted_is_zero_at_any_time():
    meter = UsageMeter(half_life_s=300.0)
    assert meter.value(0.0) == 0.0
    assert meter.value(-5.0) == 0.0
    assert meter.value(1e9) == 0.0


def test_a_count_halves_every_half_life():
    meter = UsageMeter(half_life_s=300.0)
    meter.add(4, now=100.0)
    assert meter.value(100.0) == 4.0
    assert meter.value(400.0) == pytest.approx(2.0)   # one half-life
    assert meter.value(700.0) == pytest.approx(1.0)   # two
    assert meter.value(1000.0) == pytest.approx(0.5)  # three
    assert meter.value(250.0) == pytest.approx(4 * 2 ** -0.5)  # half a half-life: 2.828...
    # Reading does not change it.
    assert meter.value(100.0) == 4.0


def test_the_docstrings_examples_with_a_five_minute_half_life():
    once_an_hour_ago = UsageMeter(half_life_s=300.0)
    once_an_hour_ago.add(1, now=0.0)
    assert once_an_hour_ago.value(3600.0) == pytest.approx(2 ** -12)  # 0.000244: ~0
    ten_a_minute_ago = UsageMeter(half_life_s=300.0)
    ten_a_minute_ago.add(10, now=0.0)
    assert ten_a_minute_ago.value(60.0) == pytest.approx(10 * 2 ** -0.2)  # 8.71: ~10


def test_adding_sums_each_request_decayed_by_its_own_age():
    meter = UsageMeter(half_life_s=300.0)
    meter.add(4, now=0.0)
    meter.add(2, now=300.0)
    # At 300 s: 4 x 1/2 + 2 = 4; at 600 s: 4 x 1/4 + 2 x 1/2 = 2.
    assert meter.value(300.0) == pytest.approx(4.0)
    assert meter.value(600.0) == pytest.approx(2.0)
    meter.add(0.5, now=600.0)  # fractions count too
    assert meter.value(600.0) == pytest.approx(2.5)
    assert meter.value(900.0) == pytest.approx(1.25)


def test_adding_zero_moves_the_clock_without_changing_the_value():
    meter = UsageMeter(half_life_s=60.0)
    meter.add(3, now=0.0)
    meter.add(0, now=60.0)
    assert meter.value(60.0) == pytest.approx(1.5)
    assert meter.value(120.0) == pytest.approx(0.75)
    # add(0) as the very first call starts the clock at zero.
    fresh = UsageMeter(half_life_s=60.0)
    fresh.add(0, now=10.0)
    assert fresh.value(10.0) == 0.0


def test_a_time_before_the_last_update_counts_as_that_time():
    meter = UsageMeter(half_life_s=300.0)
    meter.add(1, now=100.0)
    assert meter.value(50.0) == 1.0  # no growth backwards
    meter.add(1, now=50.0)           # a late report: counted as at 100 s
    assert meter.value(100.0) == pytest.approx(2.0)
    assert meter.value(400.0) == pytest.approx(1.0)  # the clock stayed at 100 s


@pytest.mark.parametrize("half_life_s", [0, -1.0, math.nan, math.inf, "300", None])
def test_half_life_validates(half_life_s):
    with pytest.raises(ValueError, match="UsageMeter.half_life_s must be a finite number > 0"):
        UsageMeter(half_life_s=half_life_s)


def test_a_negative_count_is_refused_and_changes_nothing():
    meter = UsageMeter(half_life_s=300.0)
    meter.add(2, now=0.0)
    with pytest.raises(ValueError, match="num_requests must be a finite number >= 0, got -1"):
        meter.add(-1, now=300.0)
    assert meter.value(300.0) == pytest.approx(1.0)


@pytest.mark.parametrize("num_requests, now", [(float("nan"), 10.0), (float("inf"), 10.0), (True, 10.0),
                                               (1, float("nan")), (1, float("inf"))])
def test_a_non_finite_count_or_time_is_refused_and_the_meter_stays_sound(num_requests, now):
    meter = UsageMeter(half_life_s=300.0)
    meter.add(2, now=0.0)
    with pytest.raises(ValueError, match="must be a finite number"):
        meter.add(num_requests, now=now)
    assert meter.value(300.0) == pytest.approx(1.0)  # unchanged, still decaying
