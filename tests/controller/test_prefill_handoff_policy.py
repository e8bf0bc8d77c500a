"""plan_prefill_handoffs: which fully loaded instance finishes each prompt waiting on a streamed one."""

from __future__ import annotations

from controller.managed_instance import ManagedInstance
from controller.prefill_handoff_policy import PrefillHandoff, plan_prefill_handoffs
from wire import InstanceState


def inst(instance_id, *, model="acme/m1", node="n1", phase=InstanceState.READY, resident=True, ongoing=0,
         waiting=()):
    return ManagedInstance(instance_id=instance_id, model_id=model, node_id=node, ray_node_id="r", actor_name=instance_id,
                           num_worker_slots=1, repository_name="m1", phase=phase, weights_resident=resident,
                           num_ongoing_requests=ongoing, prefills_at_frontier=tuple(waiting))


def test_each_waiting_prompt_goes_to_the_least_busy_loaded_instance_of_its_model():
    new = inst("i3", node="n3", resident=False, ongoing=3, waiting=("a", "b", "c"))
    plan = plan_prefill_handoffs([new, inst("i1", ongoing=1), inst("i2", node="n2", ongoing=0)], saturated_requests=4)
    # i2 (0) takes a; then both have 1 and the smaller id wins; and so on, counting what they were given.
    assert plan == [PrefillHandoff("a", "i3", "i2"), PrefillHandoff("b", "i3", "i1"), PrefillHandoff("c", "i3", "i2")]


def test_no_helper_that_is_saturated_loading_streamed_draining_or_of_another_model():
    new = inst("i9", resident=False, waiting=("a",))
    others = [inst("busy", ongoing=4), inst("loading", phase=InstanceState.LOADING),
              inst("streamed", resident=False), inst("draining", node="nd"), inst("other", model="acme/m2"),
              inst("stopping", phase=InstanceState.STOPPING)]
    assert plan_prefill_handoffs([new, *others], saturated_requests=4, draining_node_ids={"nd"}) == []


def test_a_helper_fills_up_to_saturation_and_prompts_in_flight_are_skipped():
    new = inst("i2", resident=False, waiting=("a", "b", "c", "d"))
    plan = plan_prefill_handoffs([new, inst("i1", ongoing=2)], saturated_requests=4, in_flight={"a"})
    assert [h.request_id for h in plan] == ["b", "c"]  # i1 had 2: room for two more


def test_nothing_moves_off_a_loaded_instance_or_one_with_nothing_waiting():
    assert plan_prefill_handoffs([inst("i1", waiting=("x",)), inst("i2"), inst("i3", resident=False)],
                                 saturated_requests=4) == []
