"""`plan_slot_reclaim` with plain numbers: when freeing a full node's slot by migration beats the
nodes with room, which instance is emptied, and every reason it declines."""

from __future__ import annotations

import pytest

from controller.managed_instance import ManagedInstance
from controller.placement_policy import NodeView, TierBandwidths, place
from controller.slot_reclaim_policy import SlotReclaimCosts, plan_slot_reclaim
from wire import InstanceState

GB = 10**9
RATES = TierBandwidths(repository_bytes_per_s=0.2e9, ssd_bytes_per_s=1e9, dram_bytes_per_s=8e9)
COSTS = SlotReclaimCosts(migrate_s_per_request=0.3, stop_s=0.5, min_gain_s=1.0)
COLD = "acme/cold"


def instance(instance_id: str, node_id: str, model_id: str = "acme/hot", *, phase=InstanceState.READY,
             load: int = 0, slots: int = 1) -> ManagedInstance:
    return ManagedInstance(instance_id, model_id, node_id, "ray", f"w-{instance_id}", slots, model_id.replace("/", "--"),
                           phase=phase, num_ongoing_requests=load)


def decision(free: dict[str, int], tiers: dict[str, set[str]]):
    """Placement of a 2 GB cold model: node -> free slots, node -> tiers holding it."""
    return place(2 * GB, [NodeView(node_id=n, num_free_slots=f, bandwidths=RATES, model_tiers=frozenset(tiers.get(n, ())))
                          for n, f in free.items()])


def plan(free, tiers, instances, draining=(), costs=COSTS):
    return plan_slot_reclaim(COLD, decision(free, tiers), instances, set(draining), costs)


# n0 is full and holds the cold model in DRAM (0.25 s); n1 has room but only the repository (10 s).
FULL_DRAM = ({"n0": 0, "n1": 1}, {"n0": {"dram"}})
HOT = [instance("a", "n0", load=2), instance("b", "n0", load=0), instance("c", "n2", load=1)]


def test_a_full_node_holding_the_checkpoint_in_dram_beats_fetching_from_the_repository():
    chosen, why = plan(*FULL_DRAM, HOT)
    assert why == ""
    assert (chosen.node_id, chosen.tier, chosen.victim_instance_id, chosen.destination_instance_id) == ("n0", "dram", "b", "c")
    assert chosen.num_requests == 0 and chosen.cost_s == pytest.approx(0.5)
    assert chosen.ready_s == pytest.approx(0.25 + 0.5) and chosen.alternative_s == pytest.approx(10.0)
    assert chosen.gain_s == pytest.approx(10.0 - 0.75)
    assert "migrate 0 request(s) of b (acme/hot) to c" in chosen.describe()
    assert chosen.to_dict()["victim_instance_id"] == "b"


def test_the_victim_with_fewest_requests_is_emptied_and_its_moves_are_costed():
    instances = [instance("a", "n0", load=3), instance("b", "n0", load=2), instance("c", "n2")]
    chosen, _ = plan(*FULL_DRAM, instances)
    assert chosen.victim_instance_id == "b" and chosen.num_requests == 2
    assert chosen.cost_s == pytest.approx(0.5 + 2 * 0.3)


def test_with_no_room_anywhere_a_reclaim_is_always_worth_it():
    # n1 holds the checkpoint on SSD (2 s) but its only instance y is its model's only copy; n0 must
    # fetch from the repository (10 s), but z can be emptied into x (same model, same node).
    solo = [instance("x", "n0", load=4), instance("y", "n1", "acme/solo", load=9), instance("z", "n0")]
    chosen, why = plan({"n0": 0, "n1": 0}, {"n1": {"ssd"}}, solo)
    assert why == "" and chosen.alternative_s is None and chosen.gain_s is None
    assert (chosen.node_id, chosen.victim_instance_id, chosen.destination_instance_id) == ("n0", "z", "x")
    assert "no node has room" in chosen.describe()
    # once y's model has a second copy, n1 wins despite 9 requests to move: 2 + 0.5 + 2.7 < 10.5 s
    chosen, _ = plan({"n0": 0, "n1": 0}, {"n1": {"ssd"}}, [*solo, instance("y2", "n0", "acme/solo")])
    assert (chosen.node_id, chosen.victim_instance_id, chosen.destination_instance_id) == ("n1", "y", "y2")
    assert chosen.ready_s == pytest.approx(2 + 0.5 + 9 * 0.3)


def test_declines_when_the_saving_is_below_the_margin():
    # n1 has room and the checkpoint on SSD (2 s); n0 full with it in DRAM: 0.25 + 0.5 = 0.75 s, saving 1.25 s.
    chosen, _ = plan({"n0": 0, "n1": 1}, {"n0": {"dram"}, "n1": {"ssd"}}, HOT)
    assert chosen is not None
    none, why = plan({"n0": 0, "n1": 1}, {"n0": {"dram"}, "n1": {"ssd"}}, HOT,
                     costs=SlotReclaimCosts(migrate_s_per_request=0.3, stop_s=0.5, min_gain_s=1.5))
    assert none is None and "does not beat the best node with room (2s) by 1.5s" in why


@pytest.mark.parametrize("instances, reason", [
    # the cold model is already served: it scales out by placement alone (no churn)
    ([*HOT, instance("s", "n2", COLD)], "already has a ready instance"),
    # the only instance of its model: emptying it would leave acme/hot unserved
    ([instance("a", "n0")], "no instance whose requests another instance of its model can take"),
    # the other copy is still loading, or stopping: no destination
    ([instance("a", "n0"), instance("l", "n2", phase=InstanceState.LOADING)], "no instance whose requests"),
    ([instance("a", "n0", phase=InstanceState.STOPPING), instance("c", "n2")], "no instance whose requests"),
    # the other copy is on a draining node
    ([instance("a", "n0"), instance("c", "n3")], "no instance whose requests"),
])
def test_declines_and_says_why(instances, reason):
    none, why = plan(*FULL_DRAM, instances, draining={"n3"})
    assert none is None and reason in why


def test_a_draining_full_node_is_never_reclaimed():
    none, why = plan(*FULL_DRAM, HOT, draining={"n0"})
    assert none is None and why == "no full node to free a slot on"


def test_a_victim_too_small_for_the_slots_needed_is_skipped():
    d = place(2 * GB, [NodeView(node_id="n0", num_free_slots=0, bandwidths=RATES, model_tiers=frozenset({"dram"}))],
              num_slots=2)
    none, _ = plan_slot_reclaim(COLD, d, [instance("a", "n0"), instance("c", "n2")], set(), COSTS, num_slots=2)
    assert none is None
    chosen, _ = plan_slot_reclaim(COLD, d, [instance("a", "n0", slots=2), instance("c", "n2", slots=2)], set(),
                                  COSTS, num_slots=2)
    assert chosen.victim_instance_id == "a"


@pytest.mark.parametrize("field, value", [("migrate_s_per_request", -1), ("stop_s", float("nan")),
                                          ("min_gain_s", "1"), ("stop_s", True)])
def test_costs_validate(field, value):
    with pytest.raises(ValueError, match=f"SlotReclaimCosts.{field} must be a finite number >= 0"):
        SlotReclaimCosts(**{field: value})


def test_where_memory_is_the_slot_only_a_victim_that_frees_enough_of_it_is_emptied():
    """n0 has free slots but 1 GiB of its worker memory budget, the cold model needs 3 GiB: b
    (the fewest requests) frees 1 GiB, too little; a frees 4 GiB and is the one emptied."""
    gib = 2**30
    instances = [instance("a", "n0", load=2), instance("b", "n0"), instance("c", "n2")]
    instances[0].memory_bytes, instances[1].memory_bytes = 4 * gib, 1 * gib
    views = [NodeView(node_id="n0", num_free_slots=2, bandwidths=RATES, model_tiers=frozenset({"dram"}),
                      free_memory_bytes=gib), NodeView(node_id="n1", num_free_slots=1, bandwidths=RATES)]
    placed = place(2 * GB, views, memory_bytes=3 * gib)
    assert placed.node_id == "n1"  # n0 would be soonest, but the instance does not fit there
    chosen, why = plan_slot_reclaim(COLD, placed, instances, set(), COSTS)
    assert why == "" and (chosen.node_id, chosen.victim_instance_id) == ("n0", "a")
