"""Tests for controller/model_plan.py: the one planner of a model's tick, with numbers: the count
is `decide`'s, the extra instances go in the stop order, sleepers wake the longest asleep first,
the start back-off holds placement, and holds are released once the model has its instances."""

from __future__ import annotations

import dataclasses

import pytest

from controller import AutoscaleState, AutoscalingPolicy, LoadSnapshot, decide
from controller.model_plan import InstanceView, ModelView, plan_model, stop_order_key

POLICY = AutoscalingPolicy(min_instances=0, max_instances=4, target_ongoing_requests=2,
                           upscale_delay_s=0.0, downscale_delay_s=0.0, keep_alive_s=30.0)
NOW = 1000.0


def view(desired: int, instances=(), sleepers=(), ongoing=0, queued=0, **fields) -> ModelView:
    return ModelView(model_id="acme/m", policy=POLICY, autoscale_state=AutoscaleState(),
                     num_desired_instances=desired, num_ongoing_requests=ongoing, num_queued_requests=queued,
                     last_request_s=NOW, restart_s=None, keep_alive_floor_s=0.0, instances=tuple(instances),
                     sleepers=tuple(sleepers), **fields)


def test_the_count_and_the_state_are_decides():
    v = view(1, [InstanceView("a", True, 2, 10.0)], ongoing=2, queued=5)
    plan = plan_model(v, NOW)
    decision, state = decide(POLICY, LoadSnapshot(num_instances=1, num_ongoing_requests=2, num_queued_requests=5,
                                                  last_request_s=NOW), AutoscaleState(), NOW)
    assert (plan.decision, plan.autoscale_state) == (decision, state)
    assert plan.num_desired_instances == 4 and plan.previous_count == 1 and plan.changes_count
    assert plan.num_missing == 3 and plan.scale_down == () and plan.may_place and not plan.releases_holds


def test_extra_instances_scale_down_loading_first_then_least_busy_then_newest():
    instances = [InstanceView("busy", True, 3, 1.0), InstanceView("idle-old", True, 0, 1.0),
                 InstanceView("idle-new", True, 0, 5.0), InstanceView("loading", False, 0, 2.0)]
    # 3 ongoing requests want 2 instances of the 4: two go, the loading one and the newer idle one.
    plan = plan_model(view(4, instances, ongoing=3), NOW)
    assert plan.num_desired_instances == 2
    assert plan.scale_down == ("loading", "idle-new")
    assert plan.num_missing == 0 and plan.wake_order == () and plan.releases_holds
    assert sorted(instances, key=stop_order_key)[0].instance_id == "loading"


def test_missing_instances_wake_the_longest_asleep_first():
    sleepers = [InstanceView("recent", False, 0, 1.0, asleep_s=900.0), InstanceView("long", False, 0, 2.0, asleep_s=100.0),
                InstanceView("middle", False, 0, 3.0, asleep_s=500.0)]
    plan = plan_model(view(0, sleepers=sleepers, queued=3), NOW)
    assert plan.num_desired_instances == 2 and plan.num_missing == 2
    assert plan.wake_order == ("long", "middle", "recent")  # all offered, in order: one that cannot wake is skipped


def test_a_model_at_its_count_wakes_nothing_and_releases_its_holds():
    plan = plan_model(view(1, [InstanceView("a", True, 1, 1.0)], [InstanceView("s", False, 0, 1.0, 5.0)], ongoing=1),
                      NOW)
    assert (plan.num_missing, plan.wake_order, plan.scale_down) == (0, (), ())
    assert plan.releases_holds and not plan.changes_count


def test_the_start_back_off_holds_placement_but_not_the_count():
    plan = plan_model(view(0, queued=1, next_start_s=NOW + 5), NOW)
    assert plan.num_desired_instances == 1 and plan.num_missing == 1 and not plan.may_place
    assert plan_model(view(0, queued=1, next_start_s=NOW), NOW).may_place


def test_the_plan_is_a_function_of_the_view():
    v = view(2, [InstanceView("a", True, 0, 1.0), InstanceView("b", False, 0, 2.0)], ongoing=0)
    assert plan_model(v, NOW) == plan_model(dataclasses.replace(v), NOW)


def test_a_negative_request_count_is_refused():
    with pytest.raises(ValueError, match="num_ongoing_requests must be >= 0"):
        InstanceView("a", True, -1, 0.0)
