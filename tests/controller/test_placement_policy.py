"""Tests for controller/placement_policy.py: tier preference, loader wait, tie-breaks, and the
locality-blind baseline on a scenario where the two disagree."""

from __future__ import annotations

import itertools

import pytest

from controller import NodeView, TierBandwidths, place, place_locality_blind
from controller.placement_policy import estimate_node, pin_tier

GB = 10**9
MODEL_BYTES = 4 * GB
# Rates per tier (bytes/s): repository 0.5 GB/s, SSD 2 GB/s, DRAM 10 GB/s, peer GPU 20 GB/s.
RATES = TierBandwidths(
    repository_bytes_per_s=0.5 * GB, ssd_bytes_per_s=2 * GB, dram_bytes_per_s=10 * GB, gpu_bytes_per_s=20 * GB
)


def _node(node_id: str, tiers: tuple[str, ...] = (), free: int = 1, wait_s: float = 0.0,
          rates: TierBandwidths = RATES) -> NodeView:
    return NodeView(node_id=node_id, num_free_slots=free, bandwidths=rates, model_tiers=frozenset(tiers),
                    loader_loads_s=(wait_s,) if wait_s else ())


def test_dram_beats_ssd_beats_repository():
    nodes = [_node("repo-only"), _node("on-ssd", ("ssd",)), _node("in-dram", ("ssd", "dram"))]
    decision = place(MODEL_BYTES, nodes)
    assert decision.placed
    assert (decision.node_id, decision.tier, decision.estimate_s) == ("in-dram", "dram", 0.4)
    assert [(e.node_id, e.tier, e.ready_s) for e in decision.estimates] == [
        ("in-dram", "dram", 0.4), ("on-ssd", "ssd", 2.0), ("repo-only", "repository", 8.0),
    ]
    assert decision.reason == (
        "soonest ready: in-dram: dram 0.4s = 0.4s (of 3 nodes with room; next on-ssd: ssd 2s = 2s)"
    )

    without_dram = place(MODEL_BYTES, nodes[:2])
    assert (without_dram.node_id, without_dram.tier, without_dram.estimate_s) == ("on-ssd", "ssd", 2.0)
    only_repo = place(MODEL_BYTES, nodes[:1])
    assert (only_repo.node_id, only_repo.tier, only_repo.estimate_s) == ("repo-only", "repository", 8.0)


def test_peer_gpu_is_the_fastest_source():
    decision = place(MODEL_BYTES, [_node("dram", ("dram",)), _node("peer", ("gpu", "dram", "ssd"))])
    assert (decision.node_id, decision.tier, decision.estimate_s) == ("peer", "gpu", 0.2)


def test_a_busy_loader_flips_the_choice():
    idle_repo = _node("idle-repo")
    busy_ssd = _node("busy-ssd", ("ssd",), wait_s=7.0)
    decision = place(MODEL_BYTES, [busy_ssd, idle_repo])
    assert (decision.node_id, decision.tier, decision.estimate_s) == ("idle-repo", "repository", 8.0)
    busy = decision.estimates[1]
    assert (busy.node_id, busy.load_s, busy.wait_s, busy.ready_s) == ("busy-ssd", 2.0, 7.0, 9.0)
    assert busy.describe() == "busy-ssd: ssd 2s + wait 7s = 9s"

    # A shorter wait keeps the SSD ahead: 2 + 5 = 7 < 8.
    decision = place(MODEL_BYTES, [_node("busy-ssd", ("ssd",), wait_s=5.0), idle_repo])
    assert (decision.node_id, decision.estimate_s) == ("busy-ssd", 7.0)


def test_a_dram_or_peer_read_does_not_wait_for_the_disk_and_network_loader():
    """The loader's wait is its disk and network path's (issue 39): a read from the node's DRAM
    copy or a peer's GPU runs beside another model's repository fetch."""
    decision = place(MODEL_BYTES, [_node("busy-dram", ("dram",), wait_s=60.0), _node("idle-ssd", ("ssd",))])
    assert (decision.node_id, decision.tier, decision.estimate_s) == ("busy-dram", "dram", 0.4)
    assert decision.estimates[0].wait_s == 0.0
    peer = place(MODEL_BYTES, [_node("busy-peer", ("gpu", "ssd"), wait_s=60.0)])
    assert (peer.tier, peer.estimate_s) == ("gpu", 0.2)


def test_locality_blind_baseline_differs_and_is_slower():
    """The roomiest node has the model only in the repository; locality picks the DRAM node."""
    nodes = [_node("roomy", free=3), _node("warm", ("dram",), free=1)]
    aware = place(MODEL_BYTES, nodes)
    blind = place_locality_blind(MODEL_BYTES, nodes)
    assert (aware.node_id, aware.tier, aware.estimate_s) == ("warm", "dram", 0.4)
    assert (blind.node_id, blind.tier, blind.estimate_s) == ("roomy", "repository", 8.0)
    assert blind.reason.startswith("most free slots: roomy: repository 8s = 8s")
    assert blind.estimate_s / aware.estimate_s == 20.0


def test_locality_blind_ties_go_to_the_smaller_node_id():
    nodes = [_node("b", free=2), _node("a", ("dram",), free=2), _node("c", free=1)]
    assert place_locality_blind(MODEL_BYTES, nodes).node_id == "a"
    assert [e.node_id for e in place_locality_blind(MODEL_BYTES, nodes).estimates] == ["a", "b", "c"]


def test_the_fastest_tier_wins_even_against_the_usual_order():
    """A node whose SSD is slower than its repository link loads from the repository."""
    rates = TierBandwidths(repository_bytes_per_s=1 * GB, ssd_bytes_per_s=0.25 * GB)
    estimate = estimate_node(MODEL_BYTES, _node("slow-disk", ("ssd",), rates=rates))
    assert (estimate.tier, estimate.load_s) == ("repository", 4.0)
    # Equal times keep the tier that is faster by nature.
    rates = TierBandwidths(repository_bytes_per_s=1 * GB, ssd_bytes_per_s=1 * GB)
    assert estimate_node(MODEL_BYTES, _node("same", ("ssd",), rates=rates)).tier == "ssd"


def test_no_free_slot():
    nodes = [_node("full-dram", ("dram",), free=0), _node("full", free=0)]
    decision = place(MODEL_BYTES, nodes)
    assert not decision.placed
    assert (decision.node_id, decision.tier, decision.estimate_s) == (None, None, None)
    assert decision.reason == "no free slot: none of 2 nodes has 1 free worker slot"
    # The estimates are still reported: the full DRAM node is where freeing a slot would pay.
    assert [(e.node_id, e.has_room) for e in decision.estimates] == [("full-dram", False), ("full", False)]
    assert place(MODEL_BYTES, []).reason == "no free slot: none of 0 nodes has 1 free worker slot"


def test_full_nodes_are_skipped_and_listed_last():
    nodes = [_node("full-dram", ("dram",), free=0), _node("ssd", ("ssd",)), _node("repo")]
    decision = place(MODEL_BYTES, nodes)
    assert decision.node_id == "ssd"
    assert [e.node_id for e in decision.estimates] == ["ssd", "repo", "full-dram"]
    assert decision.estimates[-1].describe() == "full-dram: dram 0.4s = 0.4s (full)"


def test_instances_needing_several_slots():
    nodes = [_node("one-slot", ("dram",), free=1), _node("two-slots", ("ssd",), free=2)]
    decision = place(MODEL_BYTES, nodes, num_slots=2)
    assert decision.node_id == "two-slots"
    assert place(MODEL_BYTES, nodes, num_slots=3).reason == "no free slot: none of 2 nodes has 3 free worker slots"


def test_ties_are_deterministic_whatever_the_input_order():
    nodes = [_node("n2", ("ssd",), free=1), _node("n1", ("ssd",), free=1), _node("n3", ("ssd",), free=2)]
    for order in itertools.permutations(nodes):
        decision = place(MODEL_BYTES, list(order))
        # Same estimate everywhere: more free slots first, then the smaller id.
        assert [e.node_id for e in decision.estimates] == ["n3", "n1", "n2"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: _node("x", ("nvme",)), "model_tiers must be a set drawn from"),
        (lambda: _node("x", ("dram",), rates=TierBandwidths(repository_bytes_per_s=GB)),
         "holds the model in 'dram' but has no dram_bytes_per_s"),
        (lambda: _node("x", free=-1), "num_free_slots must be an integer >= 0"),
        (lambda: _node("x", wait_s=-0.1), "loader_loads_s must be finite seconds >= 0"),
        (lambda: _node(""), "node_id must be a non-empty string"),
        (lambda: TierBandwidths(repository_bytes_per_s=0), "repository_bytes_per_s must be a finite number > 0"),
        (lambda: TierBandwidths(repository_bytes_per_s=GB, ssd_bytes_per_s=float("inf")),
         "ssd_bytes_per_s must be a finite number > 0 or None"),
        (lambda: place(0, [_node("a")]), "model_bytes must be an integer >= 1"),
        (lambda: place(GB, [_node("a"), _node("a")]), "node ids must be unique"),
        (lambda: place(GB, [_node("a")], num_slots=0), "num_slots must be an integer >= 1"),
    ],
)
def test_invalid_inputs(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_pin_tier_reads_the_dram_copy_only_when_placement_chose_dram():
    assert [pin_tier(tier) for tier in ("dram", "ssd", "repository", "gpu")] == ["dram", "ssd", "ssd", "ssd"]
    with pytest.raises(ValueError, match="tier must be one of"):
        pin_tier("nvme")


GIB = 2**30


def _budget(node_id: str, free_gib: float, tiers: tuple[str, ...] = (), free: int = 4) -> NodeView:
    return NodeView(node_id=node_id, num_free_slots=free, bandwidths=RATES, model_tiers=frozenset(tiers),
                    free_memory_bytes=int(free_gib * GIB))


def test_memory_is_the_slot_locality_first_then_best_fit():
    """Three nodes with free slots; the instance takes 3 GiB of a worker memory budget. 'small'
    (2 GiB free) has no room; of the two where it fits from the repository, the best fit ('snug',
    leaving 1 GiB) beats the roomier one; a node holding the model in DRAM beats both (locality first)."""
    nodes = [_budget("roomy", 10), _budget("snug", 4), _budget("small", 2)]
    decision = place(MODEL_BYTES, nodes, memory_bytes=3 * GIB)
    assert (decision.node_id, decision.tier) == ("snug", "repository")
    assert [(e.node_id, e.has_room) for e in decision.estimates] == [("snug", True), ("roomy", True),
                                                                     ("small", False)]
    assert decision.reason == ("soonest ready: snug: repository 8s = 8s, 4 GiB free (of 2 nodes with room; "
                               "next roomy: repository 8s = 8s, 10 GiB free)")
    with_locality = place(MODEL_BYTES, [*nodes, _budget("warm", 10, ("dram",))], memory_bytes=3 * GIB)
    assert (with_locality.node_id, with_locality.tier) == ("warm", "dram")


def test_a_node_without_a_budget_is_the_worst_fit_and_memory_does_not_change_slot_placement():
    assert place(MODEL_BYTES, [_node("unbounded", free=4), _budget("bounded", 5)], memory_bytes=GIB).node_id == \
        "bounded"
    nodes = [_node("a", free=2), _node("b", free=3)]
    with_memory, without = place(MODEL_BYTES, nodes, memory_bytes=GIB), place(MODEL_BYTES, nodes)
    assert (with_memory.node_id, with_memory.reason) == (without.node_id, without.reason) == (
        "b", without.reason)


def test_no_room_for_memory_says_which_node_came_closest():
    decision = place(MODEL_BYTES, [_budget("a", 2), _budget("b", 2.5), _budget("full", 9, free=0)],
                     memory_bytes=3 * GIB)
    assert not decision.placed
    assert decision.reason == ("no room: none of 3 nodes has 1 free worker slot and 3 GiB of worker memory free "
                               "for the instance's weights and KV pool (most free: b, 2.5 GiB)")
    slots_only = place(MODEL_BYTES, [_budget("full", 9, free=0)], memory_bytes=3 * GIB)
    assert slots_only.reason == "no free slot: none of 1 nodes has 1 free worker slot"


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_free_memory_and_the_instances_share_are_checked(bad):
    with pytest.raises(ValueError, match="free_memory_bytes must be an integer >= 0 or None"):
        NodeView(node_id="n", num_free_slots=1, bandwidths=RATES, free_memory_bytes=bad)
    with pytest.raises(ValueError, match="memory_bytes must be an integer >= 0"):
        place(MODEL_BYTES, [_node("n")], memory_bytes=bad)
