"""Tests for controller/autoscale_policy.py: exact decisions, hysteresis timing, scale to zero."""

from __future__ import annotations

import pytest

from controller import AutoscaleState, AutoscalingPolicy, LoadSnapshot, decide
from controller.autoscale_policy import desired_instances, keep_alive_for

POLICY = AutoscalingPolicy(
    min_instances=0, max_instances=4, target_ongoing_requests=2,
    upscale_delay_s=2.0, downscale_delay_s=10.0, keep_alive_s=30.0,
)


def _snap(num_instances: int, ongoing: int = 0, queued: int = 0, last_request_s: float | None = None) -> LoadSnapshot:
    return LoadSnapshot(
        num_instances=num_instances, num_ongoing_requests=ongoing, num_queued_requests=queued,
        last_request_s=last_request_s,
    )


def _run(policy, ticks, state=None):
    """Feed (now, snapshot) ticks through `decide`, threading the state; return the counts."""
    state = state or AutoscaleState()
    counts = []
    for now, snapshot in ticks:
        decision, state = decide(policy, snapshot, state, now)
        counts.append(decision.num_instances)
    return counts, state


@pytest.mark.parametrize(
    ("demand", "min_instances", "expected"),
    [(0, 0, 0), (1, 0, 1), (2, 0, 1), (3, 0, 2), (4, 0, 2), (7, 0, 4), (8, 0, 4), (100, 0, 4), (0, 1, 1), (0, 4, 4)],
)
def test_desired_is_ceil_of_demand_over_target_clamped(demand, min_instances, expected):
    policy = AutoscalingPolicy(min_instances=min_instances, max_instances=4, target_ongoing_requests=2)
    assert desired_instances(policy, demand) == expected


def test_fractional_target():
    policy = AutoscalingPolicy(max_instances=10, target_ongoing_requests=1.5)
    assert [desired_instances(policy, d) for d in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 4]


def test_cold_start_is_immediate_and_counts_queued_requests():
    decision, state = decide(POLICY, _snap(0, queued=3), AutoscaleState(), now=0.0)
    assert decision.num_instances == 2  # ceil(3 / 2), no upscale delay
    assert decision.num_desired_instances == 2
    assert decision.reason == "cold start 0 -> 2: 3 requests and no instance (ceil(3/2))"
    assert state == AutoscaleState()

    decision, _ = decide(POLICY, _snap(0, queued=1), AutoscaleState(), now=0.0)
    assert decision.num_instances == 1
    decision, _ = decide(POLICY, _snap(0, queued=50), AutoscaleState(), now=0.0)
    assert decision.num_instances == 4  # clamped to max_instances


def test_zero_instances_and_no_demand_stays_at_zero():
    decision, state = decide(POLICY, _snap(0), AutoscaleState(), now=5.0)
    assert (decision.num_instances, decision.reason) == (0, "scaled to zero, no requests")


def test_upscale_waits_for_upscale_delay():
    # 1 instance, 6 ongoing -> wants 3; upscale_delay_s = 2.
    ticks = [(t, _snap(1, ongoing=6)) for t in (10.0, 11.0, 11.9, 12.0)]
    counts, state = _run(POLICY, ticks)
    assert counts == [1, 1, 1, 3]
    assert state == AutoscaleState()

    decision, state = decide(POLICY, _snap(1, ongoing=6), AutoscaleState(), now=10.0)
    assert decision.reason == "holding 1: want 3 (6 requests / target 2) for 0s of upscale_delay_s 2"
    assert state == AutoscaleState(wish_direction=1, wish_since_s=10.0)
    decision, state = decide(POLICY, _snap(1, ongoing=6), state, now=12.5)
    assert decision.reason == "scale up 1 -> 3: 6 requests / target 2 for 2.5s >= upscale_delay_s 2"


def test_upscale_applies_the_desire_at_the_moment_it_fires():
    ticks = [(0.0, _snap(1, ongoing=3)), (1.0, _snap(1, ongoing=5)), (2.0, _snap(1, ongoing=8))]
    counts, _ = _run(POLICY, ticks)
    assert counts == [1, 1, 4]  # wished for 2, then 3, acted at t=2 on 4


def test_a_broken_wish_restarts_the_delay():
    ticks = [
        (0.0, _snap(1, ongoing=6)),  # wish up begins
        (1.0, _snap(1, ongoing=2)),  # load back to one instance's worth: wish cleared
        (2.0, _snap(1, ongoing=6)),  # wish up begins again here
        (3.0, _snap(1, ongoing=6)),
        (4.0, _snap(1, ongoing=6)),  # 2 s after it restarted
    ]
    counts, _ = _run(POLICY, ticks)
    assert counts == [1, 1, 1, 1, 3]


def test_direction_flip_restarts_the_delay():
    ticks = [
        (0.0, _snap(2, ongoing=8)),   # wants 4: up
        (1.0, _snap(2, ongoing=1)),   # wants 1: down (the up wish is dropped)
        (2.5, _snap(2, ongoing=8)),   # up again, counted from 2.5
        (4.0, _snap(2, ongoing=8)),
        (4.5, _snap(2, ongoing=8)),
    ]
    counts, _ = _run(POLICY, ticks)
    assert counts == [2, 2, 2, 2, 4]


def test_downscale_waits_for_downscale_delay():
    # 4 instances, 2 ongoing -> wants 1; downscale_delay_s = 10.
    ticks = [(t, _snap(4, ongoing=2, last_request_s=t)) for t in (100.0, 105.0, 109.99, 110.0)]
    counts, _ = _run(POLICY, ticks)
    assert counts == [4, 4, 4, 1]


def test_keep_alive_then_scale_to_zero():
    # One instance, idle since the last request at t=100; keep_alive_s = 30.
    decision, state = decide(POLICY, _snap(1, last_request_s=100.0), AutoscaleState(), now=110.0)
    assert (decision.num_instances, decision.reason) == (1, "steady at 1: idle 10s of keep_alive_s 30")
    decision, state = decide(POLICY, _snap(1, last_request_s=100.0), state, now=129.9)
    assert decision.num_instances == 1
    decision, state = decide(POLICY, _snap(1, last_request_s=100.0), state, now=130.0)
    assert decision.num_instances == 0
    assert decision.reason == "scale to zero 1 -> 0: idle 30s >= keep_alive_s 30"


def test_idle_fleet_shrinks_to_one_then_to_zero():
    """Three idle instances: down to one warm instance after downscale_delay_s, to zero after
    keep_alive_s of idleness."""
    times_and_counts = ((100.0, 3), (105.0, 3), (110.0, 3), (120.0, 1), (130.0, 1))
    ticks = [(t, _snap(n, last_request_s=100.0)) for t, n in times_and_counts]
    counts, _ = _run(POLICY, ticks)
    assert counts == [3, 3, 1, 1, 0]


def test_a_request_during_keep_alive_resets_it():
    ticks = [
        (110.0, _snap(1, last_request_s=100.0)),
        (125.0, _snap(1, ongoing=1, last_request_s=125.0)),  # traffic again
        (150.0, _snap(1, last_request_s=126.0)),             # idle 24 s: keep
        (156.0, _snap(1, last_request_s=126.0)),             # idle 30 s: zero
    ]
    counts, _ = _run(POLICY, ticks)
    assert counts == [1, 1, 1, 0]


def test_keep_alive_without_a_last_request_counts_from_first_idle_tick():
    ticks = [(50.0, _snap(1)), (79.0, _snap(1)), (80.0, _snap(1))]
    counts, state = _run(POLICY, ticks)
    assert counts == [1, 1, 0]
    assert state.idle_since_s == 50.0


def test_min_instances_never_scales_to_zero():
    policy = AutoscalingPolicy(min_instances=1, max_instances=4, keep_alive_s=30.0)
    decision, _ = decide(policy, _snap(1, last_request_s=0.0), AutoscaleState(), now=10_000.0)
    assert (decision.num_instances, decision.reason) == (1, "steady at 1")


def test_zero_keep_alive_scales_to_zero_at_once():
    policy = AutoscalingPolicy(max_instances=2, keep_alive_s=0.0)
    decision, _ = decide(policy, _snap(1, last_request_s=5.0), AutoscaleState(), now=5.0)
    assert decision.num_instances == 0


def test_zero_upscale_delay_is_immediate():
    policy = AutoscalingPolicy(max_instances=4, target_ongoing_requests=1, upscale_delay_s=0.0)
    decision, state = decide(policy, _snap(1, ongoing=3), AutoscaleState(), now=1.0)
    assert decision.num_instances == 3
    assert state == AutoscaleState()


def test_limits_changed_under_a_running_model_apply_at_once():
    decision, _ = decide(POLICY, _snap(6, ongoing=20), AutoscaleState(), now=0.0)
    assert (decision.num_instances, decision.reason) == (4, "6 -> 4: outside [0, 4] (max_instances changed)")
    policy = AutoscalingPolicy(min_instances=2, max_instances=4)
    decision, _ = decide(policy, _snap(0), AutoscaleState(), now=0.0)
    assert (decision.num_instances, decision.reason) == (2, "0 -> 2: outside [2, 4] (min_instances changed)")
    # Idle and above a lowered max: down to the bound, not straight to zero.
    decision, _ = decide(POLICY, _snap(6, last_request_s=0.0), AutoscaleState(), now=1.0)
    assert decision.num_instances == 4


def test_a_day_in_the_life():
    """A cold model gets a burst, grows, cools down and scales to zero; every tick checked."""
    ticks = [
        (0.0, _snap(0, queued=1)),                         # cold start -> 1
        (0.5, _snap(1, ongoing=1, last_request_s=0.5)),    # steady
        (1.0, _snap(1, ongoing=7, last_request_s=1.0)),    # wants 4: wait
        (2.0, _snap(1, ongoing=7, last_request_s=2.0)),    # 1 s
        (3.0, _snap(1, ongoing=7, last_request_s=3.0)),    # 2 s -> 4
        (4.0, _snap(4, ongoing=7, last_request_s=4.0)),    # steady at 4
        (5.0, _snap(4, ongoing=1, last_request_s=5.0)),    # wants 1: wait
        (15.0, _snap(4, ongoing=1, last_request_s=15.0)),  # 10 s -> 1
        (16.0, _snap(1, last_request_s=15.5)),             # idle, keep warm
        (45.4, _snap(1, last_request_s=15.5)),             # idle 29.9 s
        (45.5, _snap(1, last_request_s=15.5)),             # idle 30 s -> 0
        (60.0, _snap(0, last_request_s=15.5)),             # stays at zero
        (61.0, _snap(0, queued=2, last_request_s=61.0)),   # cold start again -> 1
    ]
    counts, _ = _run(POLICY, ticks)
    assert counts == [1, 1, 1, 1, 4, 4, 4, 1, 1, 1, 0, 0, 1]


def test_restart_with_a_lost_state_only_delays():
    """A controller that lost its AutoscaleState waits the full delay again; it never jumps."""
    _, state = decide(POLICY, _snap(1, ongoing=6), AutoscaleState(), now=0.0)
    decision, _ = decide(POLICY, _snap(1, ongoing=6), AutoscaleState(), now=1.5)  # state lost
    assert decision.num_instances == 1
    decision, _ = decide(POLICY, _snap(1, ongoing=6), state, now=2.0)  # state kept
    assert decision.num_instances == 3


RESTART_POLICY = AutoscalingPolicy(max_instances=4, keep_alive_s=30.0, keep_alive_per_restart=20.0,
                                   min_keep_alive_s=10.0, max_keep_alive_s=180.0)


@pytest.mark.parametrize(
    ("restart_s", "expected"),
    [(0.1, 10.0), (0.5, 10.0), (1.5, 30.0), (4.0, 80.0), (9.0, 180.0), (60.0, 180.0), (None, 180.0)],
)
def test_keep_alive_per_restart_is_that_multiple_within_its_bounds(restart_s, expected):
    assert keep_alive_for(RESTART_POLICY, restart_s) == pytest.approx(expected)


def test_fixed_keep_alive_ignores_the_restart_time():
    assert keep_alive_for(POLICY, 9.0) == keep_alive_for(POLICY, 0.1) == keep_alive_for(POLICY, None) == 30.0


def test_a_quick_restart_scales_to_zero_sooner_than_a_slow_one():
    """Idle since t=100: the 0.5 s restart goes at the 10 s floor, the 4 s one holds until 80 s
    (20 x 4), whatever the fixed keep_alive_s (30) says."""
    def count_at(now: float, restart_s: float) -> int:
        snapshot = LoadSnapshot(num_instances=1, last_request_s=100.0, restart_s=restart_s)
        return decide(RESTART_POLICY, snapshot, AutoscaleState(), now)[0].num_instances

    assert [count_at(t, 0.5) for t in (109.9, 110.0)] == [1, 0]
    assert [count_at(t, 4.0) for t in (130.0, 179.9, 180.0)] == [1, 1, 0]
    decision, _ = decide(RESTART_POLICY, LoadSnapshot(num_instances=1, last_request_s=100.0, restart_s=4.0),
                         AutoscaleState(), 180.0)
    assert decision.reason == "scale to zero 1 -> 0: idle 80s >= keep-alive 80s (20 x restart 4s)"
    decision, _ = decide(RESTART_POLICY, LoadSnapshot(num_instances=1, last_request_s=100.0), AutoscaleState(), 150.0)
    assert decision.reason == "steady at 1: idle 50s of keep-alive 180s (20 x restart unknown)"


def test_the_contended_floor_holds_an_idle_instance_at_least_that_long():
    """While slots are contended the controller raises the keep-alive to a floor (60 s here): the
    0.5 s restart's 10 s keep-alive becomes 60 s, the 9 s restart's 180 s stays, and a fixed one
    below the floor is raised too."""
    assert keep_alive_for(RESTART_POLICY, 0.5, 60.0) == 60.0
    assert keep_alive_for(RESTART_POLICY, 9.0, 60.0) == 180.0
    assert keep_alive_for(POLICY, 0.5, 60.0) == 60.0 and keep_alive_for(POLICY, 0.5, 0.0) == 30.0

    def decision_at(now: float, floor_s: float):
        snapshot = LoadSnapshot(num_instances=1, last_request_s=100.0, restart_s=0.5, keep_alive_floor_s=floor_s)
        return decide(RESTART_POLICY, snapshot, AutoscaleState(), now)[0]

    assert decision_at(110.0, 0.0).num_instances == 0
    assert [decision_at(t, 60.0).num_instances for t in (110.0, 159.9, 160.0)] == [1, 1, 0]
    assert decision_at(130.0, 60.0).reason == ("steady at 1: idle 30s of keep-alive 60s (the floor while slots are "
                                               "contended)")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_instances": 1, "keep_alive_floor_s": -1.0}, "keep_alive_floor_s must be a finite number >= 0, got -1.0"),
        ({"num_instances": 1, "restart_s": -1.0}, "restart_s must be a finite number >= 0 or None, got -1.0"),
        ({"num_instances": 1, "restart_s": float("nan")}, "restart_s must be a finite number >= 0 or None"),
        ({"num_instances": -1}, "num_instances must be an integer >= 0, got -1"),
        ({"num_instances": 1, "num_ongoing_requests": 1.5}, "num_ongoing_requests must be an integer >= 0"),
        ({"num_instances": True}, "num_instances must be an integer >= 0, got True"),
    ],
)
def test_snapshot_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoadSnapshot(**kwargs)
