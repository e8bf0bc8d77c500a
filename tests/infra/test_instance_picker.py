"""`InstancePicker`: least-loaded under a cap, ties by the controller's report, broken ones skipped."""

from __future__ import annotations

from infra.instance_picker import InstancePicker
from infra.serving_cluster import InstanceRoute


def route(instance_id: str, reported: int = 0) -> InstanceRoute:
    return InstanceRoute(instance_id=instance_id, actor_name=f"w-{instance_id}", namespace=None, node_id="n0",
                         num_ongoing_requests=reported)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_picks_the_least_loaded_under_the_cap_with_the_reports_as_tie_break():
    picker = InstancePicker(max_ongoing_per_instance=2, broken_instance_s=5.0, clock=Clock())
    routes = [route("a", reported=3), route("b", reported=1)]
    picks = []
    for _ in range(5):
        chosen = picker.pick(routes)
        picks.append(chosen.instance_id if chosen else None)
        if chosen:
            picker.reserve(chosen)
    assert picks == ["b", "a", "b", "a", None]  # b wins ties on its lower report; 2 each is the cap
    assert picker.inflight() == {"a": 2, "b": 2}
    picker.release(routes[0])
    assert picker.pick(routes).instance_id == "a" and picker.inflight() == {"a": 1, "b": 2}


def test_a_broken_instance_is_skipped_until_its_time_is_up_or_it_leaves_the_table():
    clock = Clock()
    picker = InstancePicker(max_ongoing_per_instance=8, broken_instance_s=5.0, clock=clock)
    routes = [route("a"), route("b")]
    picker.mark_broken(routes[0])
    assert picker.pick(routes).instance_id == "b"
    assert picker.pick(routes[:1]) is None
    clock.now += 5.0
    assert picker.pick(routes).instance_id == "a"
    picker.mark_broken(routes[0])
    picker.keep_only({"b"})  # a left the routing table: its mark is forgotten
    assert picker.pick(routes[:1]).instance_id == "a"
