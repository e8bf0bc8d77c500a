"""Slots held for waiting models, and what placement sees of a node past them: one rule.

When the controller frees a slot for a waiting model (an eviction or a preemption by the
`SlotSharer`, a reclaim by the `SlotReclaimer`), the slot is held for that model until its
instance starts there: every other model's placement must see the node without it, or it would
take the slot the waiting model paid for. Each of those collaborators keeps its own record of
why it holds a slot; what the slot is (its node, its slots, its share of the node's worker
memory budget) is a `SlotHold`, and `views_past_holds` is the one rule that takes every hold
but the placing model's own out of the views, for the controller and the simulator alike
(`sim.thaw_policy.ThawPolicy`, which holds a slot as `SlotSharer` does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from controller.placement_policy import NodeView

__all__ = ["SlotHold", "views_past_holds"]


@dataclass(frozen=True)
class SlotHold:
    """Slots held on one node for one waiting model."""

    node_id: str
    num_slots: int
    memory_bytes: int = 0  # of the node's worker memory budget (0 where the node has none)

    def __post_init__(self) -> None:
        if self.num_slots < 0 or self.memory_bytes < 0:
            raise ValueError(f"a hold on {self.node_id} of {self.num_slots} slots and {self.memory_bytes} bytes: "
                             "both must be >= 0")


def views_past_holds(views: Sequence[NodeView], holds: Iterable[tuple[Hashable, SlotHold]],
                     for_model: Hashable) -> list[NodeView]:
    """`views` as `for_model`'s placement must see them: the slots and memory held for other models
    taken out (never below zero); its own holds stay in (it is what they are for). `holds`: (the
    model it is held for, the hold). A view of a node nobody else holds on is returned as it is."""
    slots: dict[str, int] = {}
    memory: dict[str, int] = {}
    for model, hold in holds:
        if model != for_model:
            slots[hold.node_id] = slots.get(hold.node_id, 0) + hold.num_slots
            memory[hold.node_id] = memory.get(hold.node_id, 0) + hold.memory_bytes
    if not slots:
        return list(views)
    return [dataclasses.replace(
        v, num_free_slots=max(0, v.num_free_slots - slots[v.node_id]),
        free_memory_bytes=None if v.free_memory_bytes is None else max(0, v.free_memory_bytes - memory[v.node_id]))
        if v.node_id in slots else v for v in views]
