"""`order_waiting` with plain numbers: the effective-wait order and its tie-break, validation, plain
FIFO without a boost, and the starvation bound of the module docstring checked by replaying
arrivals step by step."""

from __future__ import annotations

import itertools
import math

import pytest

from controller.slot_queue_policy import DEFAULT_PRIORITY_BOOST_S, WaitingModel, effective_wait_s, order_waiting

# Effective waits with the default boost (10 s per priority step):
#   a: 30 + 0 x 10 = 30   b: 5 + 3 x 10 = 35   c: 12 + 2 x 10 = 32   d: 40 - 1 x 10 = 30
MODELS = [WaitingModel(model_id="acme/a", oldest_wait_s=30.0),
          WaitingModel(model_id="acme/b", oldest_wait_s=5.0, priority=3),
          WaitingModel(model_id="acme/c", oldest_wait_s=12.0, priority=2),
          WaitingModel(model_id="acme/d", oldest_wait_s=40.0, priority=-1)]


def ids(models) -> list[str]:
    return [m.model_id for m in models]


def test_effective_wait_adds_priority_times_boost():
    assert DEFAULT_PRIORITY_BOOST_S == 10.0
    assert [effective_wait_s(m) for m in MODELS] == [30.0, 35.0, 32.0, 30.0]
    assert [effective_wait_s(m, 2.5) for m in MODELS] == [30.0, 12.5, 17.0, 37.5]


def test_largest_effective_wait_first_ties_to_the_smaller_id_whatever_the_input_order():
    # b 35, c 32, then a and d tie at 30: a < d.
    for permutation in itertools.permutations(MODELS):
        assert ids(order_waiting(permutation)) == ["acme/b", "acme/c", "acme/a", "acme/d"]
    # Boost 2.5: d 37.5, a 30, c 17, b 12.5.
    assert ids(order_waiting(MODELS, 2.5)) == ["acme/d", "acme/a", "acme/c", "acme/b"]
    assert order_waiting([]) == []


def test_without_a_boost_or_with_equal_priorities_it_is_fifo_by_oldest_request():
    assert ids(order_waiting(MODELS, 0.0)) == ["acme/d", "acme/a", "acme/c", "acme/b"]  # 40, 30, 12, 5
    same = [WaitingModel(model_id=m.model_id, oldest_wait_s=m.oldest_wait_s, priority=4) for m in MODELS]
    assert ids(order_waiting(same, 100.0)) == ["acme/d", "acme/a", "acme/c", "acme/b"]


@pytest.mark.parametrize("wait", [-1.0, math.nan, math.inf])
def test_a_waiting_model_validates_its_wait(wait):
    with pytest.raises(ValueError, match="acme/x: oldest_wait_s must be a finite number >= 0"):
        WaitingModel(model_id="acme/x", oldest_wait_s=wait)


@pytest.mark.parametrize("boost", [-1.0, math.nan, math.inf])
def test_the_boost_validates(boost):
    with pytest.raises(ValueError, match="priority_boost_s must be a finite number >= 0"):
        order_waiting(MODELS, boost)


LOW = "acme/low"


def replay(*, priority_boost_s: float, slot_every_s: int, high_priority: int, until_s: int,
           stop_when_low_served: bool = True):
    """acme/low (priority 0) starts waiting at 0 s; from 1 s on, a new model acme/high-NNN of
    `high_priority` starts waiting every second; every `slot_every_s` seconds one slot comes free
    and goes to the head of `order_waiting`, until `until_s` (or acme/low is served). Returns when each
    model was served and how many models were still waiting after each step (its slot given out)."""
    arrived_at = {LOW: 0}
    priority = {LOW: 0}
    served_at: dict[str, int] = {}
    num_waiting_after: dict[int, int] = {}
    for now in range(until_s + 1):
        if now >= 1:
            model_id = f"acme/high-{now:03d}"
            arrived_at[model_id], priority[model_id] = now, high_priority
        if now > 0 and now % slot_every_s == 0:
            waiting = [WaitingModel(model_id=m, oldest_wait_s=float(now - t), priority=priority[m])
                       for m, t in arrived_at.items() if m not in served_at]
            served_at[order_waiting(waiting, priority_boost_s)[0].model_id] = now
        num_waiting_after[now] = len(arrived_at) - len(served_at)
        if stop_when_low_served and LOW in served_at:
            break
    return served_at, num_waiting_after


def test_a_low_priority_model_is_served_within_the_stated_bound():
    # Boost 10 s, high priority 2: W = (p_max - p_low) x boost = (2 - 0) x 10 = 20 s.
    # high-s's effective wait is (now - s) + 20 against low's now, so every high model arriving at
    # s < 20 is ahead of low, and high-020 ties it (acme/high-020 < acme/low); high-021 on are behind.
    # A slot every T = 5 s: slot k at 5k serves high-k (k = 1..20, high-020 at 100 s), then low at 105 s.
    # At t + W = 20 s, slots 5..20 have served high-001..004, leaving high-005..020 (16) and low: K = 17,
    # so the bound is W + K x T = 20 + 17 x 5 = 105 s, met exactly.
    W, T = 20, 5
    served_at, num_waiting_after = replay(priority_boost_s=10.0, slot_every_s=T, high_priority=2, until_s=110)
    K = num_waiting_after[W]
    assert K == 17
    assert served_at[LOW] == 105 == W + K * T
    assert [served_at[f"acme/high-{k:03d}"] for k in range(1, 21)] == list(range(5, 105, 5))
    assert len(served_at) == 21  # high-021 and later never went ahead of low


@pytest.mark.parametrize("priority_boost_s, slot_every_s, high_priority", [
    (b, t, p) for b in (5, 10, 30) for t in (1, 3, 7) for p in (1, 3)
])
def test_the_bound_holds_across_boosts_slot_rates_and_priorities(priority_boost_s, slot_every_s, high_priority):
    W = high_priority * priority_boost_s  # (p_max - p_low) x boost, p_low = 0
    until_s = 2 * (W + 1) * (slot_every_s + 1) * 3  # well past any bound of these scenarios
    served_at, num_waiting_after = replay(priority_boost_s=float(priority_boost_s), slot_every_s=slot_every_s,
                                          high_priority=high_priority, until_s=until_s)
    assert LOW in served_at
    K = num_waiting_after[W]  # the models still waiting at t + W (low among them: served later)
    assert served_at[LOW] > W
    assert served_at[LOW] <= W + K * slot_every_s


def test_with_no_boost_the_replay_is_plain_fifo():
    # Boost 0: low (waiting since 0 s) is older than every high model, so it takes the first slot
    # at 5 s; then high-001, high-002, ... in arrival order, one per slot.
    served_at, _ = replay(priority_boost_s=0.0, slot_every_s=5, high_priority=2, until_s=50,
                          stop_when_low_served=False)
    by_time = [m for m, _ in sorted(served_at.items(), key=lambda item: item[1])]
    assert by_time == [LOW] + [f"acme/high-{k:03d}" for k in range(1, 10)]
    assert served_at[LOW] == 5


def deadline(model_id: str, oldest: float, newest: float, load: float | None, priority: int = 0) -> WaitingModel:
    return WaitingModel(model_id=model_id, oldest_wait_s=oldest, newest_wait_s=newest, load_s=load, ttft_slo_s=5.0,
                        priority=priority)


def test_with_deadlines_a_savable_model_goes_first_least_slack_first():
    """Slack = 5 - newest - load: fresh 5 - 0 - 1 = 4; urgent 5 - 3 - 1 = 1; lost 5 - 10 - 1 < 0;
    unknown (no load estimate) is treated as lost; starving has waited the 300 s bound."""
    models = [deadline("acme/fresh", 0.0, 0.0, 1.0), deadline("acme/urgent", 3.0, 3.0, 1.0),
              deadline("acme/lost", 20.0, 10.0, 1.0), deadline("acme/unknown", 30.0, 0.0, None),
              deadline("acme/starving", 300.0, 0.5, 60.0)]
    assert [m.slack_s() for m in models] == [4.0, 1.0, -6.0, None, -55.5]
    for permutation in itertools.permutations(models):
        assert ids(order_waiting(permutation, 10.0, 300.0)) == [
            "acme/starving", "acme/urgent", "acme/fresh", "acme/unknown", "acme/lost"]
    # Without the bound: the age order of before, whatever the deadlines.
    assert ids(order_waiting(models, 10.0)) == ["acme/starving", "acme/unknown", "acme/lost", "acme/urgent",
                                                "acme/fresh"]


def test_a_priority_step_is_worth_priority_boost_s_of_slack():
    # low: slack 1; high (priority 1): slack 4 - 10 = -6 in the key: ahead.
    models = [deadline("acme/low", 3.0, 3.0, 1.0), deadline("acme/high", 0.0, 0.0, 1.0, priority=1)]
    assert ids(order_waiting(models, 10.0, 300.0)) == ["acme/high", "acme/low"]
    assert ids(order_waiting(models, 0.0, 300.0)) == ["acme/low", "acme/high"]


def test_the_deadline_order_passes_a_lost_model_over_for_starvation_bound_s_at_most():
    """acme/lost (its requests past saving) starts waiting at 0 s; a fresh savable model arrives
    every second and one slot frees every 2 s: the fresh ones go first until acme/lost has waited
    the bound (20 s here), and it has the first slot after that."""
    arrived = {"acme/lost": 0}
    served: dict[str, int] = {}
    for now in range(1, 60):
        arrived[f"acme/fresh-{now:03d}"] = now
        if now % 2 == 0:
            waiting = [deadline(m, float(now - t), float(now - t), 1.0 if m != "acme/lost" else 90.0)
                       for m, t in arrived.items() if m not in served]
            served[order_waiting(waiting, 10.0, 20.0)[0].model_id] = now
        if "acme/lost" in served:
            break
    assert served["acme/lost"] == 20


@pytest.mark.parametrize("field", ["newest_wait_s", "load_s", "ttft_slo_s"])
def test_the_deadline_figures_validate(field):
    with pytest.raises(ValueError, match=f"acme/x: {field} must be a finite number >= 0 or None"):
        WaitingModel(model_id="acme/x", oldest_wait_s=1.0, **{field: -1.0})
    with pytest.raises(ValueError, match="starvation_bound_s must be a finite number >= 0 or None"):
        order_waiting(MODELS, 10.0, math.nan)
