"""Tests for controller/slot_holds.py: placement sees a node past the slots and memory held for
other models (summed across holders, never below zero), its own holds left in, and views of nodes
nobody holds on returned as they are."""

from __future__ import annotations

import pytest

from controller import NodeView, TierBandwidths
from controller.slot_holds import SlotHold, views_past_holds

RATES = TierBandwidths(repository_bytes_per_s=1e9)


def view(node_id: str, slots: int, memory: int | None = None) -> NodeView:
    return NodeView(node_id=node_id, num_free_slots=slots, bandwidths=RATES, free_memory_bytes=memory)


def test_other_models_holds_are_taken_out_summed_and_clamped():
    views = [view("a", 4, 100), view("b", 2, None), view("c", 3, 50)]
    holds = [("m1", SlotHold("a", 1, 30)), ("m2", SlotHold("a", 2, 40)),  # two holders on a: summed
             ("m1", SlotHold("b", 5)),                                    # more than b has: clamped at 0
             ("mine", SlotHold("c", 3, 50))]                              # the placing model's own: kept
    seen = views_past_holds(views, holds, "mine")
    assert [(v.node_id, v.num_free_slots, v.free_memory_bytes) for v in seen] == [
        ("a", 1, 30), ("b", 0, None), ("c", 3, 50)]
    assert seen[2] is views[2]  # nobody else holds there: the same view


def test_no_holds_leave_the_views_as_they_are():
    views = [view("a", 4)]
    assert views_past_holds(views, [], "m") == views
    assert views_past_holds(views, [("m", SlotHold("a", 4))], "m") == views


def test_a_negative_hold_is_refused():
    with pytest.raises(ValueError, match="both must be >= 0"):
        SlotHold("a", -1)
