"""`choose_eviction` with plain numbers: the GDSF score and its frequency floor, priority before
cost, the waiting model's load time on the victim's node, the tie-breaks, every instance it keeps
and why, and the settings' validation."""

from __future__ import annotations

import math

import pytest

from controller.eviction_policy import EvictionCandidate, EvictionSettings, choose_eviction, eviction_score

SETTINGS = EvictionSettings(min_idle_s=0.5, min_frequency=0.1, usage_half_life_s=300.0)
COLD = "acme/cold"
# The waiting model loads in 2 s on either node unless a test says otherwise.
LOAD = {"n0": 2.0, "n1": 2.0}


def idle(instance_id: str, model_id: str = "acme/idle", node_id: str = "n0", *, idle_s: float = 60.0,
         reload_s: float = 4.0, **fields) -> EvictionCandidate:
    """An idle READY instance, the only one of its model (min_instances 0), never asked since start."""
    return EvictionCandidate(instance_id=instance_id, model_id=model_id, node_id=node_id, idle_s=idle_s,
                             reload_s=reload_s, **fields)


def evict(candidates, load=LOAD, **kwargs):
    return choose_eviction(COLD, candidates, load_s_by_node=load, settings=SETTINGS, **kwargs)


@pytest.mark.parametrize("frequency, reload_s, slots, score", [
    (0.0, 4.0, 1, 0.1 * 4.0 / 1),   # never asked: floor 0.1 -> 0.4
    (0.05, 4.0, 1, 0.1 * 4.0 / 1),  # below the floor: still 0.1 -> 0.4
    (0.1, 4.0, 1, 0.1 * 4.0 / 1),   # at the floor -> 0.4
    (3.0, 8.0, 2, 3.0 * 8.0 / 2),   # above it, two slots -> 12
    (10.0, 0.5, 1, 10.0 * 0.5),     # busy but cheap to reload from DRAM -> 5
])
def test_score_is_frequency_times_reload_over_slots_with_a_frequency_floor(frequency, reload_s, slots, score):
    candidate = idle("a", frequency=frequency, reload_s=reload_s, num_worker_slots=slots)
    assert eviction_score(candidate, SETTINGS) == pytest.approx(score)


def test_the_lowest_total_goes_first_and_the_reason_spells_out_the_score():
    # All on n0 (waiting model loads in 2 s there), so the order is the score's:
    #   a: frequency 5 x reload 4 s / 1 = 20       total 22
    #   b: frequency 0 -> floor 0.1 x 10 s / 1 = 1 total 3
    #   c: frequency 0.5 x 1 s (DRAM) / 1 = 0.5    total 2.5
    candidates = [idle("a", "acme/chat", frequency=5.0, reload_s=4.0),
                  idle("b", "acme/rare", frequency=0.0, reload_s=10.0, reload_tier="repository"),
                  idle("c", "acme/docs", frequency=0.5, reload_s=1.0, reload_tier="dram")]
    decision = evict(candidates)
    assert decision.victim.instance_id == "c"
    assert decision.score == pytest.approx(0.5)
    assert [(i, s, t) for i, s, t in decision.ranked] == [
        ("c", pytest.approx(0.5), pytest.approx(2.5)),
        ("b", pytest.approx(1.0), pytest.approx(3.0)),
        ("a", pytest.approx(20.0), pytest.approx(22.0)),
    ]
    assert decision.reason == (
        "evict idle c (acme/docs, priority 0, idle 60.0s) on n0 for acme/cold: score 0.5 = frequency 0.5 x "
        "reload 1s from dram / 1 slot(s), + 2s to load acme/cold there; next b (acme/rare) score 1")


def test_a_lone_victim_names_no_runner_up():
    decision = evict([idle("a", reload_s=4.0)])
    # floor 0.1 x 4 s / 1 = 0.4; + 2 s on n0
    assert decision.victim.instance_id == "a" and decision.score == pytest.approx(0.4)
    assert decision.ranked == (("a", pytest.approx(0.4), pytest.approx(2.4)),)
    assert decision.reason.endswith("+ 2s to load acme/cold there")
    assert "next" not in decision.reason


def test_a_lower_priority_goes_first_even_when_dearer():
    # vip: priority 1, floor 0.1 x 1 s = 0.1 (total 2.1); bulk: priority 0, 10 x 20 s = 200 (total 202).
    vip = idle("vip", "acme/vip", priority=1, frequency=0.0, reload_s=1.0)
    bulk = idle("bulk", "acme/bulk", priority=0, frequency=10.0, reload_s=20.0)
    decision = evict([vip, bulk])
    assert decision.victim.instance_id == "bulk" and decision.score == pytest.approx(200.0)
    assert [i for i, _, _ in decision.ranked] == ["bulk", "vip"]
    assert decision.reason.startswith("evict idle bulk (acme/bulk, priority 0, idle 60.0s) on n0 for acme/cold: "
                                      "score 200 = frequency 10 x reload 20s")
    # A negative priority goes before priority 0.
    low = idle("low", "acme/low", priority=-1, frequency=50.0, reload_s=50.0)
    assert evict([vip, bulk, low]).victim.instance_id == "low"


def test_the_total_adds_the_waiting_models_load_time_on_the_victims_node():
    # The waiting model sits in DRAM on n0 (0.5 s) and only in the repository for n1 (20 s).
    #   a on n0: 2 x 2 s = 4,    total 4 + 0.5 = 4.5
    #   b on n1: floor 0.1 x 10 s = 1, total 1 + 20 = 21
    # b is the cheaper cache entry, but stopping it makes the waiting model pay 20 s to load.
    a = idle("a", "acme/chat", "n0", frequency=2.0, reload_s=2.0)
    b = idle("b", "acme/rare", "n1", frequency=0.0, reload_s=10.0)
    decision = evict([a, b], load={"n0": 0.5, "n1": 20.0})
    assert decision.victim.instance_id == "a" and decision.score == pytest.approx(4.0)
    assert decision.ranked == (("a", pytest.approx(4.0), pytest.approx(4.5)),
                               ("b", pytest.approx(1.0), pytest.approx(21.0)))
    assert "+ 0.5s to load acme/cold there; next b (acme/rare) score 1" in decision.reason
    # The same instances with the DRAM copy on n1 instead: b 1 + 0.5 = 1.5 < a 4 + 20 = 24.
    decision = evict([a, b], load={"n0": 20.0, "n1": 0.5})
    assert decision.victim.instance_id == "b" and decision.score == pytest.approx(1.0)
    assert decision.ranked == (("b", pytest.approx(1.0), pytest.approx(1.5)),
                               ("a", pytest.approx(4.0), pytest.approx(24.0)))


def test_ties_go_to_the_longest_idle_then_the_smaller_id():
    # Same model, node and cost (floor 0.1 x 4 s = 0.4, total 2.4): idle 120 s beats 60 s; c and b tie on that too.
    same = dict(model_id="acme/chat", num_model_instances=3)
    candidates = [idle("a", idle_s=60.0, **same), idle("c", idle_s=120.0, **same), idle("b", idle_s=120.0, **same)]
    decision = evict(candidates)
    assert decision.victim.instance_id == "b"
    assert [i for i, _, _ in decision.ranked] == ["b", "c", "a"]
    assert all(s == pytest.approx(0.4) and t == pytest.approx(2.4) for _, s, t in decision.ranked)
    # The input order does not matter.
    assert [i for i, _, _ in evict(list(reversed(candidates))).ranked] == ["b", "c", "a"]


@pytest.mark.parametrize("fields, why", [
    (dict(draining=True), "its node drains"),
    (dict(ready=False), "not ready"),
    (dict(num_ongoing_requests=1), "busy"),
    (dict(num_queued_requests=2), "busy"),
    (dict(num_model_instances=1, min_instances=1), "its model is at min_instances 1"),
    (dict(num_model_instances=2, min_instances=3), "its model is at min_instances 3"),
    (dict(idle_s=0.2), "idle only 0.2s < min_idle_s 0.5"),
    (dict(node_id="n9"), "the waiting model cannot be placed on its node"),
])
def test_every_rule_that_keeps_an_instance_names_it(fields, why):
    fields = {"model_id": "acme/idle", "node_id": "n0", **fields}
    decision = evict([idle("a", **fields)])
    assert decision.victim is None and decision.score is None and decision.ranked == ()
    assert decision.reason == f"no idle instance to evict: a (acme/idle): {why}"


@pytest.mark.parametrize("fields", [
    dict(num_model_instances=2, min_instances=1),  # one above the floor
    dict(idle_s=0.5),                              # exactly min_idle_s
])
def test_just_past_a_keeping_rule_the_instance_is_evicted(fields):
    assert evict([idle("a", **fields)]).victim.instance_id == "a"


def test_every_kept_instance_is_listed_in_the_reason():
    decision = evict([idle("a", draining=True), idle("b", "acme/busy", num_ongoing_requests=3),
                      idle("c", "acme/fresh", idle_s=0.125)])
    assert decision.victim is None
    assert decision.reason == ("no idle instance to evict: a (acme/idle): its node drains; b (acme/busy): busy; "
                               "c (acme/fresh): idle only 0.125s < min_idle_s 0.5")


def test_a_victim_must_free_the_slots_the_waiting_model_needs():
    one_slot = idle("a")
    decision = evict([one_slot], num_slots=2)
    assert decision.victim is None
    assert decision.reason == "no idle instance to evict: a (acme/idle): frees 1 of the 2 slots needed"
    # A free slot on another node does not help: the two slots must be on one node.
    assert evict([one_slot], num_slots=2, free_slots_by_node={"n1": 1}).victim is None
    # One free slot on n0 plus a's makes two.
    decision = evict([one_slot], num_slots=2, free_slots_by_node={"n0": 1})
    assert decision.victim.instance_id == "a" and decision.score == pytest.approx(0.4)
    # A two-slot instance frees both itself: 1 x 6 s / 2 slots = 3.
    two_slots = idle("b", "acme/big", num_worker_slots=2, frequency=1.0, reload_s=6.0)
    decision = evict([one_slot, two_slots], num_slots=2)
    assert decision.victim.instance_id == "b" and decision.score == pytest.approx(3.0)
    assert decision.ranked == (("b", pytest.approx(3.0), pytest.approx(5.0)),)
    assert "score 3 = frequency 1 x reload 6s from ssd / 2 slot(s)" in decision.reason


def test_the_waiting_models_own_instances_are_never_candidates():
    # Its own idle copy would be the cheapest (0.1 x 1 s), but stopping it frees nothing for it.
    own = idle("own", COLD, reload_s=1.0)
    decision = evict([own])
    assert decision.victim is None and decision.reason == "no idle instance to evict: no other model holds a slot"
    assert evict([]).reason == "no idle instance to evict: no other model holds a slot"
    decision = evict([own, idle("a", reload_s=4.0)])
    assert decision.victim.instance_id == "a"
    assert [i for i, _, _ in decision.ranked] == ["a"]


def test_settings_defaults_and_numbers_become_floats():
    assert EvictionSettings() == EvictionSettings(min_idle_s=0.5, min_frequency=0.1, usage_half_life_s=300.0)
    settings = EvictionSettings(min_idle_s=0, min_frequency=1, usage_half_life_s=60)
    assert (settings.min_idle_s, settings.min_frequency, settings.usage_half_life_s) == (0.0, 1.0, 60.0)
    assert all(isinstance(v, float) for v in (settings.min_idle_s, settings.min_frequency, settings.usage_half_life_s))


@pytest.mark.parametrize("field, value, bound", [
    ("min_idle_s", -1, ">= 0"),
    ("min_idle_s", math.nan, ">= 0"),
    ("min_idle_s", math.inf, ">= 0"),
    ("min_idle_s", "1", ">= 0"),
    ("min_idle_s", True, ">= 0"),
    ("min_frequency", 0, "> 0"),
    ("min_frequency", -0.1, "> 0"),
    ("usage_half_life_s", 0.0, "> 0"),
    ("usage_half_life_s", math.inf, "> 0"),
    ("usage_half_life_s", None, "> 0"),
    ("max_displaced_requests", 0, "> 0"),
    ("max_displaced_requests", math.nan, "> 0"),
])
def test_settings_validate(field, value, bound):
    with pytest.raises(ValueError, match=f"EvictionSettings.{field} must be a finite number {bound}, got "):
        EvictionSettings(**{field: value})


@pytest.mark.parametrize("field, value, match", [("num_worker_slots", 0, "num_worker_slots must be an integer >= 1"),
                                                 ("reload_s", -1.0, "reload_s must be a finite number >= 0"),
                                                 ("frequency", float("nan"), "frequency must be a finite number")])
def test_a_candidate_with_impossible_figures_is_refused(field, value, match):
    from controller.eviction_policy import EvictionCandidate

    fields = dict(instance_id="i", model_id="acme/x", node_id="n0", idle_s=1.0, reload_s=1.0)
    with pytest.raises(ValueError, match=match):
        EvictionCandidate(**{**fields, field: value})


def test_a_start_overhead_in_reload_s_keeps_a_small_popular_model():
    """What bench/multimodel.py showed: priced by its read alone a tiny model asked for ~16 times
    (0.23 ms from DRAM) looks cheaper to drop than a rarely used one (70 ms from the repository);
    with a start's fixed cost (1.5 s) in both reloads, frequency decides."""
    from controller.eviction_policy import EvictionCandidate, EvictionSettings, choose_eviction

    read_only = [EvictionCandidate(instance_id="hot", model_id="acme/hot", node_id="n0", idle_s=2.0, frequency=15.8,
                                   reload_s=0.00023, reload_tier="dram"),
                 EvictionCandidate(instance_id="rare", model_id="acme/rare", node_id="n0", idle_s=2.0,
                                   frequency=0.2, reload_s=0.07, reload_tier="repository")]
    settings = EvictionSettings()
    # hot 15.8 x 0.00023 = 0.0036 < rare 0.2 x 0.07 = 0.014: the popular model goes
    assert choose_eviction("acme/w", read_only, load_s_by_node={"n0": 1.0}, settings=settings).victim.instance_id == "hot"
    with_overhead = [EvictionCandidate(**{**c.__dict__, "reload_s": c.reload_s + 1.5}) for c in read_only]
    decision = choose_eviction("acme/w", with_overhead, load_s_by_node={"n0": 1.0}, settings=settings)
    assert decision.victim.instance_id == "rare"  # 0.2 x 1.57 = 0.314 < 15.8 x 1.50023 = 23.7
    assert decision.score == pytest.approx(0.2 * 1.57)


def test_an_instance_whose_requests_would_arrive_during_the_load_is_kept():
    """A busy model idle between two requests is not evicted for a newcomer whose slow load would
    leave it waiting: its decayed count 433 over a 300 s half-life is ~1 request/s (433 x ln 2 / 300),
    so a 2 s load displaces ~2 of its requests; a 0.5 s load only ~0.5."""
    popular = idle("pop", "acme/pop", frequency=433.0)
    decision = evict([popular])
    assert decision.victim is None
    assert decision.reason == ("no idle instance to evict: pop (acme/pop): ~2 of its requests would arrive during "
                               "the 2s load (max_displaced_requests 1)")
    assert evict([popular], load={"n0": 0.5}).victim.instance_id == "pop"
    # A rarely used model on the same node goes instead.
    assert evict([popular, idle("rare", "acme/rare", frequency=0.5)]).victim.instance_id == "rare"
    assert EvictionSettings().request_rate(433.0) == pytest.approx(1.0, rel=1e-3)


GIB = 2**30


def test_where_one_instance_frees_too_little_memory_victims_are_collected_until_the_newcomer_fits():
    """Memory is the slot: n0 has 1 GiB of its budget free and the newcomer needs 4 GiB. In rank
    order (totals: a 2.4, b 2.6, c 2.8, d 3.0) a frees 1 GiB on n0, b 2 GiB on n1, c 2 GiB on n0:
    n0 now has 1 + 1 + 2 = 4 GiB, so a and c go together (n1 would still need d as well)."""
    candidates = [idle("a", "acme/a", "n0", reload_s=4.0, memory_bytes=1 * GIB),
                  idle("b", "acme/b", "n1", reload_s=6.0, memory_bytes=2 * GIB),
                  idle("c", "acme/c", "n0", reload_s=8.0, memory_bytes=2 * GIB),
                  idle("d", "acme/d", "n1", reload_s=10.0, memory_bytes=3 * GIB)]
    decision = evict(candidates, memory_bytes=4 * GIB, free_memory_by_node={"n0": 1 * GIB, "n1": 0})
    assert [v.instance_id for v in decision.victims] == ["a", "c"]
    assert decision.victim.instance_id == "a"
    assert decision.score == pytest.approx(0.4 + 0.8)
    assert decision.reason == (
        "evict idle a (acme/a, priority 0, idle 60.0s) on n0 for acme/cold: score 0.4 = frequency 0.1 x reload "
        "4s from ssd / 1 slot(s), + 2s to load acme/cold there; with c (acme/c, score 0.8) until it fits: "
        "3 GiB freed + 1 GiB free >= 4 GiB needed")


def test_one_victim_that_makes_room_alone_is_chosen_as_without_a_budget():
    candidates = [idle("a", "acme/a", "n0", reload_s=4.0, memory_bytes=3 * GIB),
                  idle("b", "acme/b", "n0", reload_s=6.0, memory_bytes=3 * GIB)]
    with_budget = evict(candidates, memory_bytes=4 * GIB, free_memory_by_node={"n0": 1 * GIB})
    without = evict(candidates)
    assert [v.instance_id for v in with_budget.victims] == [v.instance_id for v in without.victims] == ["a"]
    assert with_budget.reason == without.reason


def test_a_node_whose_idle_instances_cannot_make_room_evicts_nothing_and_says_how_short_it_is():
    candidates = [idle("a", "acme/a", "n0", memory_bytes=1 * GIB),
                  idle("b", "acme/b", "n0", memory_bytes=1 * GIB),
                  idle("busy", "acme/busy", "n0", memory_bytes=8 * GIB, num_ongoing_requests=1)]
    decision = evict(candidates, load={"n0": 2.0}, memory_bytes=4 * GIB, free_memory_by_node={"n0": 1 * GIB})
    assert decision.victim is None and decision.victims == ()
    assert decision.reason == ("no idle instances to evict make room: acme/cold needs 4 GiB of worker memory and "
                               "evicting every idle instance on n0 (2) would leave 3 GiB free")
    assert [r[0] for r in decision.ranked] == ["a", "b"]


def test_a_candidates_memory_must_be_a_whole_number_of_bytes():
    with pytest.raises(ValueError, match="memory_bytes must be an integer >= 0"):
        idle("a", memory_bytes=-1)


def test_a_sleeper_goes_before_any_awake_idle_instance_of_its_priority_and_frees_memory_not_slots():
    # "sleeper" costs more to drop (score 10 x 4 = 40) than "cheap" (0.4), yet goes first: it is
    # asleep, wanted by nobody now. Below its model's min_instances it is still eligible (it is
    # not one of its instances), and a higher priority still keeps it behind lower ones.
    sleeper = idle("sleeper", "acme/s", asleep=True, frequency=10.0, min_instances=1, num_model_instances=0,
                   memory_bytes=100)
    cheap = idle("cheap", "acme/c", memory_bytes=600)
    decision = evict([cheap, sleeper], free_slots_by_node={"n0": 1}, memory_bytes=150,
                     free_memory_by_node={"n0": 100})
    assert decision.victim is sleeper and decision.victims == (sleeper,)
    assert decision.reason.startswith("evict asleep sleeper (acme/s, priority 0, idle 60.0s) on n0 for acme/cold")
    assert [r[0] for r in decision.ranked] == ["sleeper", "cheap"]
    # Not enough memory from the sleeper alone: the awake one goes with it, in that order.
    decision = evict([cheap, sleeper], free_slots_by_node={"n0": 1}, memory_bytes=700,
                     free_memory_by_node={"n0": 100})
    assert decision.victims == (sleeper, cheap)
    # A sleeper holds no slot: with none free, dropping it makes no room, and it is kept.
    decision = evict([sleeper], free_slots_by_node={"n0": 0}, memory_bytes=50, free_memory_by_node={"n0": 0})
    assert decision.victim is None
    assert "sleeper (acme/s): asleep, it holds no slot and the node has fewer than the 1 slots needed free" \
        in decision.reason
    # Priority first: a sleeper of a higher-priority model goes after an awake lower one.
    high = idle("high", "acme/h", asleep=True, priority=5, memory_bytes=100)
    assert evict([high, cheap], free_slots_by_node={"n0": 1}).victim is cheap


def test_a_waiting_model_whose_requests_are_past_saving_evicts_only_after_lost_wait_s():
    """Deadline 5 s, the waiting model loads in 2 s on n0 and 40 s on n1 (repository there)."""
    candidates = [idle("a", node_id="n0"), idle("b", "acme/other", node_id="n1")]
    load = {"n0": 2.0, "n1": 40.0}
    # Its newest request waited 1 s: 1 + 2 <= 5 on n0, 1 + 40 > 5 on n1: only a may go.
    decision = evict(candidates, load, oldest_wait_s=4.0, newest_wait_s=1.0, ttft_slo_s=5.0)
    assert decision.victim.instance_id == "a"
    decision = evict(candidates[1:], load, oldest_wait_s=4.0, newest_wait_s=1.0, ttft_slo_s=5.0)
    assert decision.victim is None
    assert decision.reason == ("no idle instance to evict: b (acme/other): acme/cold's newest request, 1s waited, would "
                               "miss its 5s deadline after the 40s load here, and its oldest has waited 4s < "
                               "lost_wait_s 60")
    # Every request past saving (newest 4 s + 2 s > 5 s): nobody goes until the oldest has waited 60 s.
    assert evict(candidates, load, oldest_wait_s=59.0, newest_wait_s=4.0, ttft_slo_s=5.0).victim is None
    assert evict(candidates, load, oldest_wait_s=60.0, newest_wait_s=4.0, ttft_slo_s=5.0).victim.instance_id == "a"
    # No deadline, or no newest wait reported: no such check (the rule before issue 39).
    assert evict(candidates, load, oldest_wait_s=59.0, newest_wait_s=4.0).victim.instance_id == "a"
    assert evict(candidates, load, oldest_wait_s=59.0, ttft_slo_s=5.0).victim.instance_id == "a"
    # The bound is a setting.
    quick = EvictionSettings(min_idle_s=0.5, min_frequency=0.1, usage_half_life_s=300.0, lost_wait_s=10.0)
    decision = choose_eviction(COLD, candidates, load_s_by_node=load, settings=quick, oldest_wait_s=12.0,
                               newest_wait_s=4.0, ttft_slo_s=5.0)
    assert decision.victim.instance_id == "a"


def test_an_asleep_instance_is_evicted_for_a_lost_request_all_the_same():
    """A sleeper is wanted by nobody now: the deadline check guards awake instances only."""
    sleeper = idle("s", asleep=True, memory_bytes=1)
    decision = evict([sleeper], {"n0": 40.0}, free_slots_by_node={"n0": 1}, oldest_wait_s=1.0, newest_wait_s=1.0,
                     ttft_slo_s=5.0)
    assert decision.victim.instance_id == "s"


@pytest.mark.parametrize("name", ["oldest_wait_s", "newest_wait_s", "ttft_slo_s"])
def test_the_deadline_figures_validate(name):
    with pytest.raises(ValueError, match=f"choose_eviction.{name} must be a finite number >= 0"):
        evict([idle("a")], **{name: -1.0})
    with pytest.raises(ValueError, match="EvictionSettings.lost_wait_s must be a finite number >= 0"):
        EvictionSettings(lost_wait_s=math.nan)
