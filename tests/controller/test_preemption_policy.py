"""`choose_preemption` with plain numbers: the wait before it acts, priority as a hard limit, the
victim order (priority, migrate before suspend, fewest requests, longest ready, id), `min_run_s`,
and every instance it never preempts."""

from __future__ import annotations

import pytest

from controller.preemption_policy import PreemptionCandidate, choose_preemption

COLD = "acme/cold"
LOAD = {"n0": 2.0, "n1": 2.0}


def busy(instance_id: str, model_id: str = "acme/chat", node_id: str = "n0", *, num_ongoing_requests: int = 2,
         ready_for_s: float = 120.0, **fields) -> PreemptionCandidate:
    """A READY instance serving two requests for two minutes, its model's only copy (so: suspend)."""
    return PreemptionCandidate(instance_id=instance_id, model_id=model_id, node_id=node_id,
                               num_ongoing_requests=num_ongoing_requests, ready_for_s=ready_for_s, **fields)


def preempt(candidates, *, priority: int = 0, oldest_wait_s: float = 30.0, **kwargs):
    """acme/cold has waited 30 s of its 10 s; min_run_s 60."""
    kwargs = {"max_wait_before_preempt_s": 10.0, "load_s_by_node": LOAD, "min_run_s": 60.0, **kwargs}
    return choose_preemption(COLD, priority=priority, oldest_wait_s=oldest_wait_s, candidates=candidates, **kwargs)


def test_nothing_happens_before_the_wait_reaches_max_wait_before_preempt_s():
    decision = preempt([busy("a")], oldest_wait_s=9.5)
    assert (decision.victim, decision.action) == (None, None)
    assert decision.reason == "acme/cold has waited 9.5s of its max_wait_before_preempt_s 10"
    # At exactly the limit it acts.
    decision = preempt([busy("a")], oldest_wait_s=10.0)
    assert (decision.victim.instance_id, decision.action) == ("a", "suspend")


def test_a_suspension_says_so():
    decision = preempt([busy("a")])
    assert (decision.victim.instance_id, decision.action) == ("a", "suspend")
    assert decision.reason == (
        "preempt a (acme/chat, priority 0, ready 120s) on n0 for acme/cold (priority 0, waited 30s >= "
        "max_wait_before_preempt_s 10): suspend its 2 request(s) until acme/chat gets a slot again")


def test_a_higher_priority_is_never_preempted_an_equal_one_is():
    vip = busy("vip", "acme/vip", priority=2, num_ongoing_requests=0, ready_for_s=1000.0)
    decision = preempt([vip], priority=1)
    assert (decision.victim, decision.action) == (None, None)
    assert decision.reason == "nothing to preempt: vip (acme/vip): priority 2 > 1"
    decision = preempt([vip], priority=2)
    assert (decision.victim.instance_id, decision.action) == ("vip", "suspend")
    assert "for acme/cold (priority 2, waited 30s" in decision.reason


def test_the_lowest_priority_goes_first():
    # x (priority 1) would be a free move (migrate, no request, ready longest); y (priority 0) must
    # suspend 7 requests, but priority comes first.
    x = busy("x", "acme/mid", priority=1, num_ongoing_requests=0, ready_for_s=1000.0, destination_instance_id="x2")
    y = busy("y", "acme/low", priority=0, num_ongoing_requests=7, ready_for_s=61.0)
    decision = preempt([x, y], priority=2)
    assert (decision.victim.instance_id, decision.action) == ("y", "suspend")
    assert decision.reason == (
        "preempt y (acme/low, priority 0, ready 61s) on n0 for acme/cold (priority 2, waited 30s >= "
        "max_wait_before_preempt_s 10): suspend its 7 request(s) until acme/low gets a slot again")
    # A negative priority goes before 0.
    z = busy("z", "acme/batch", priority=-1, num_ongoing_requests=50)
    assert preempt([x, y, z], priority=2).victim.instance_id == "z"


def test_at_equal_priority_a_migration_beats_a_suspension():
    # s suspends 1 request; m migrates 5 to m2: nobody pauses, so m goes despite more requests.
    s = busy("s", "acme/solo", num_ongoing_requests=1)
    m = busy("m", "acme/chat", num_ongoing_requests=5, destination_instance_id="m2")
    decision = preempt([s, m])
    assert (decision.victim.instance_id, decision.action) == ("m", "migrate")
    assert decision.reason == (
        "preempt m (acme/chat, priority 0, ready 120s) on n0 for acme/cold (priority 0, waited 30s >= "
        "max_wait_before_preempt_s 10): migrate its 5 request(s) to m2")


def test_then_fewest_requests_then_longest_ready_then_smaller_id():
    # All suspend at priority 0: a has 3 requests; b, c, d one each, ready 100, 300, 300 s.
    candidates = [busy("a", "acme/a", num_ongoing_requests=3, ready_for_s=5000.0),
                  busy("d", "acme/d", num_ongoing_requests=1, ready_for_s=300.0),
                  busy("b", "acme/b", num_ongoing_requests=1, ready_for_s=100.0),
                  busy("c", "acme/c", num_ongoing_requests=1, ready_for_s=300.0)]
    order = []
    while candidates:
        decision = preempt(candidates)
        order.append(decision.victim.instance_id)
        candidates = [c for c in candidates if c.instance_id != order[-1]]
    # c and d tie on requests and ready time (c < d); b ready only 100 s; a has 3 requests.
    assert order == ["c", "d", "b", "a"]


def test_a_victim_must_have_run_min_run_s():
    decision = preempt([busy("a", ready_for_s=59.0)])
    assert decision.victim is None
    assert decision.reason == "nothing to preempt: a (acme/chat): ready only 59s < min_run_s 60"
    assert preempt([busy("a", ready_for_s=60.0)]).victim.instance_id == "a"
    # The younger instance is skipped for an older one, even a worse victim.
    decision = preempt([busy("young", "acme/a", ready_for_s=30.0, num_ongoing_requests=0,
                             destination_instance_id="y2"), busy("old", "acme/b", num_ongoing_requests=9)])
    assert (decision.victim.instance_id, decision.action) == ("old", "suspend")


def test_a_victim_must_have_run_as_long_as_the_waiting_model_takes_to_load_there():
    """Slow storage lengthens the quantum: a slot alternates between two models in turns at least as
    long as the load between them, never mostly loading (the simulator's thrash at 40-190 s loads)."""
    slow = {"n0": 90.0, "n1": 30.0}
    decision = preempt([busy("a", node_id="n0", ready_for_s=80.0)], load_s_by_node=slow, min_run_s=2.0)
    assert decision.victim is None
    assert decision.reason == "nothing to preempt: a (acme/chat): ready only 80s < the 90s acme/cold needs to load there"
    assert preempt([busy("a", node_id="n0", ready_for_s=90.0)], load_s_by_node=slow, min_run_s=2.0).victim
    # Where the load is quicker the same age is enough.
    decision = preempt([busy("a", node_id="n0", ready_for_s=80.0), busy("b", node_id="n1", ready_for_s=80.0)],
                       load_s_by_node=slow, min_run_s=2.0)
    assert decision.victim.instance_id == "b"


@pytest.mark.parametrize("fields, why", [
    (dict(draining=True), "its node drains"),
    (dict(ready=False), "not ready"),
    (dict(node_id="n9"), "acme/cold cannot be placed on its node"),
])
def test_instances_never_preempted(fields, why):
    decision = preempt([busy("a", **{"node_id": "n0", **fields})])
    assert (decision.victim, decision.action) == (None, None)
    assert decision.reason == f"nothing to preempt: a (acme/chat): {why}"


def test_a_victim_must_free_the_slots_needed():
    decision = preempt([busy("a")], num_slots=2)
    assert decision.reason == "nothing to preempt: a (acme/chat): frees 1 of the 2 slots needed"
    assert preempt([busy("a")], num_slots=2, free_slots_by_node={"n1": 1}).victim is None
    assert preempt([busy("a")], num_slots=2, free_slots_by_node={"n0": 1}).victim.instance_id == "a"
    assert preempt([busy("a"), busy("b", "acme/big", num_worker_slots=2)], num_slots=2).victim.instance_id == "b"


def test_every_kept_instance_is_listed_and_own_instances_are_skipped():
    decision = preempt([busy("own", COLD), busy("a", draining=True), busy("b", "acme/vip", priority=1)])
    assert decision.victim is None
    assert decision.reason == "nothing to preempt: a (acme/chat): its node drains; b (acme/vip): priority 1 > 0"
    assert preempt([busy("own", COLD)]).reason == "nothing to preempt: no other model holds a slot"
    assert preempt([]).reason == "nothing to preempt: no other model holds a slot"


# --- with a deadline (issue 39): equal priorities preempt only to save a request's deadline ---------


def test_an_equal_priority_is_preempted_only_when_the_newest_request_can_still_meet_its_deadline():
    # Loads of 2 s on both nodes; the newest request has waited 2.5 s of its 5 s: 2.5 s left >= 2 s.
    decision = preempt([busy("a")], oldest_wait_s=30.0, newest_wait_s=2.5, ttft_slo_s=5.0)
    assert (decision.victim.instance_id, decision.action) == ("a", "suspend")
    assert decision.reason == (
        "preempt a (acme/chat, priority 0, ready 120s) on n0 for acme/cold (priority 0, waited 30s >= "
        "max_wait_before_preempt_s 10, and its newest request, 2.5s waited, can still meet its 5s deadline after "
        "the 2s load): suspend its 2 request(s) until acme/chat gets a slot again")
    # 3.5 s waited: 1.5 s left < the 2 s load. Past the bound (30 s), it is kept all the same.
    decision = preempt([busy("a")], oldest_wait_s=30.0, newest_wait_s=3.5, ttft_slo_s=5.0)
    assert decision.victim is None
    assert decision.reason == ("nothing to preempt: a (acme/chat): of equal priority, and no request of acme/cold "
                               "would meet its 5s deadline after the 2s load there (its newest has waited 3.5s)")
    # Nothing queued: nothing to save. And a deadline never preempts before the bound.
    assert preempt([busy("a")], newest_wait_s=None, ttft_slo_s=5.0).victim is None
    early = preempt([busy("a")], oldest_wait_s=3.0, newest_wait_s=0.0, ttft_slo_s=5.0)
    assert (early.victim, early.reason) == (None, "acme/cold has waited 3s of its max_wait_before_preempt_s 10")


def test_with_a_deadline_a_node_where_the_load_fits_it_is_the_only_one_preempted_on():
    load = {"n0": 4.0, "n1": 1.0}
    decision = preempt([busy("far", node_id="n0", ready_for_s=300.0), busy("near", node_id="n1")],
                       load_s_by_node=load, newest_wait_s=2.0, ttft_slo_s=5.0)
    assert decision.victim.instance_id == "near"
    assert "far (acme/chat): of equal priority, and no request of acme/cold would meet its 5s deadline after the " \
           "4s load there" in preempt([busy("far", node_id="n0")], load_s_by_node=load, newest_wait_s=2.0,
                                      ttft_slo_s=5.0).reason


def test_with_a_deadline_a_lower_priority_is_still_preempted_after_the_bound():
    low = busy("low", priority=-1)
    decision = preempt([low], priority=0, oldest_wait_s=30.0, newest_wait_s=20.0, ttft_slo_s=5.0)
    assert decision.victim is low  # no deadline to save, but the bounded wait holds for lower priorities
    assert "(priority 0, waited 30s >= max_wait_before_preempt_s 10): suspend" in decision.reason
    # Deadlines off (ttft_slo_s None): the bound alone, for every priority, as before.
    assert preempt([busy("a")], oldest_wait_s=30.0, newest_wait_s=20.0).victim.instance_id == "a"
