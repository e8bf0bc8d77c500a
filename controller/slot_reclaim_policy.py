"""When a cold model would be ready soonest on a full node: free a slot there by migration.

Placement (`placement_policy.place`) only considers nodes with a free slot. But the node where a
cold model's checkpoint sits in DRAM may be full, while the nodes with room would have to fetch it
from the repository -- or no node has room at all, and the model's queued requests would time
out. `plan_slot_reclaim` looks at the full nodes placement ranked, fastest first, and asks whether
one of their instances can be emptied: its running requests live-migrated to another ready
instance of the same model (the `migration_policy.choose_destination` rules), then the instance
stopped, so the slot goes to the cold model. It is worth it when

    reclaimed node's ready time + migration cost  <  best node with room's ready time - min_gain_s

(always, when no node has room). The migration cost is estimated per request moved plus the stop
of the emptied worker; the plan carries every figure, so ``thaw status`` and the log show what
was decided and why.

Guards against churn:
- only for a model with no ready instance (its requests wait on this cold start; a model that is
  already served scales out through placement as usual);
- the victim belongs to another model that keeps a ready instance elsewhere (the destination),
  so nothing becomes unserved; that model's autoscaler may later start a replacement, and since
  it has a ready instance, that replacement never reclaims a slot in turn;
- a model under load may lose an instance this way: its requests move to its other instance and
  are still served, and its autoscaler starts a replacement when a slot frees; the alternative is
  the cold model's requests timing out (429/503) until some model idles;
- never a loading or stopping instance, nor one on a draining node, nor a victim bigger than the
  slots needed (one instance is emptied per plan).

On each full node the victim is the instance with the fewest requests to move (then the smallest
id); among the nodes, the soonest ready with the cost included (then the smallest node id). A pure function of plain values: tested with numbers alone.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from controller.managed_instance import ManagedInstance
from controller.migration_policy import choose_destination
from controller.placement_policy import NodeEstimate, PlacementDecision
from wire import InstanceState

__all__ = ["SlotReclaimCosts", "SlotReclaimPlan", "plan_slot_reclaim"]


def _non_negative(name: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"SlotReclaimCosts.{name} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SlotReclaimCosts:
    """What emptying an instance is estimated to cost, and how much it must save to be done.

    Fields:
        migrate_s_per_request: one live migration, handshake to hand-off (KV migration of a few
            thousand tokens took 0.05-0.3 s end to end on the dev machine kind; see bench/migration.py).
        stop_s: stopping the emptied worker and its slot becoming free.
        min_gain_s: the reclaim must beat the best node with room by at least this much (a margin
            for the estimates' error: moving requests is not free for their clients).
    """

    migrate_s_per_request: float = 0.3
    stop_s: float = 0.5
    min_gain_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("migrate_s_per_request", "stop_s", "min_gain_s"):
            object.__setattr__(self, name, _non_negative(name, getattr(self, name)))

    def cost_s(self, num_requests: int) -> float:
        return self.stop_s + num_requests * self.migrate_s_per_request


@dataclass(frozen=True)
class SlotReclaimPlan:
    """Empty `victim_instance_id` on `node_id` into `destination_instance_id`, then place there."""

    model_id: str  # the cold model the slot is for
    node_id: str
    tier: str  # where the cold model's checkpoint would load from on that node
    victim_instance_id: str
    victim_model_id: str
    destination_instance_id: str
    num_requests: int  # requests to migrate (the victim's last report)
    cost_s: float  # estimated migration + stop
    ready_s: float  # estimated time until the cold model is ready there, cost included
    alternative_s: float | None  # the best node with room's estimate; None: no node has room

    @property
    def gain_s(self) -> float | None:
        return None if self.alternative_s is None else self.alternative_s - self.ready_s

    def describe(self) -> str:
        against = ("no node has room" if self.alternative_s is None
                   else f"best node with room {self.alternative_s:.3g}s, saves {self.gain_s:.3g}s")
        return (f"free a slot on {self.node_id} for {self.model_id}: migrate {self.num_requests} request(s) of "
                f"{self.victim_instance_id} ({self.victim_model_id}) to {self.destination_instance_id}, stop it, "
                f"load from {self.tier}: {self.ready_s:.3g}s incl. {self.cost_s:.3g}s to free the slot ({against})")

    def to_dict(self) -> dict[str, object]:
        return {"model_id": self.model_id, "node_id": self.node_id, "tier": self.tier,
                "victim_instance_id": self.victim_instance_id, "victim_model_id": self.victim_model_id,
                "destination_instance_id": self.destination_instance_id, "num_requests": self.num_requests,
                "cost_s": self.cost_s, "ready_s": self.ready_s, "alternative_s": self.alternative_s,
                "gain_s": self.gain_s, "description": self.describe()}


def _victims(node: NodeEstimate, model_id: str, num_slots: int, instances: Sequence[ManagedInstance],
             draining: Collection[str]) -> list[tuple[ManagedInstance, ManagedInstance]]:
    """(victim, destination) pairs on `node`, fewest requests first."""
    pairs = []
    for victim in instances:
        if (victim.node_id != node.node_id or victim.model_id == model_id or victim.phase is not InstanceState.READY
                or node.num_free_slots + victim.num_worker_slots < num_slots
                or (node.free_memory_bytes is not None
                    and node.free_memory_bytes + victim.memory_bytes < node.memory_bytes)):
            continue  # stopping it would not make room (slots, or the node's worker memory budget)
        destination, _ = choose_destination(victim, instances, draining)
        if destination is not None:
            pairs.append((victim, destination))
    return sorted(pairs, key=lambda p: (p[0].num_ongoing_requests, p[0].instance_id))


def plan_slot_reclaim(model_id: str, decision: PlacementDecision, instances: Sequence[ManagedInstance],
                      draining_node_ids: Collection[str], costs: SlotReclaimCosts, num_slots: int = 1
                      ) -> tuple[SlotReclaimPlan | None, str]:
    """(a plan, "") or (None, why not). `decision` is placement's for `model_id` (its estimates
    rank full nodes too); `instances` every instance the controller knows."""
    if any(i.model_id == model_id and i.phase is InstanceState.READY for i in instances):
        return None, f"{model_id} already has a ready instance: it scales out where there is room"
    with_room = [e for e in decision.estimates if e.has_room]
    alternative = min((e.ready_s for e in with_room), default=None)
    full = sorted((e for e in decision.estimates if not e.has_room and e.node_id not in draining_node_ids),
                  key=lambda e: (e.ready_s, e.node_id))
    if not full:
        return None, "no full node to free a slot on"
    plans, why_not = [], []
    for node in full:
        pairs = _victims(node, model_id, num_slots, instances, draining_node_ids)
        if not pairs:
            why_not.append(f"{node.node_id}: no instance whose requests another instance of its model can take")
            continue
        victim, destination = pairs[0]
        cost = costs.cost_s(victim.num_ongoing_requests)
        plans.append(SlotReclaimPlan(model_id=model_id, node_id=node.node_id, tier=node.tier,
                                     victim_instance_id=victim.instance_id, victim_model_id=victim.model_id,
                                     destination_instance_id=destination.instance_id,
                                     num_requests=victim.num_ongoing_requests, cost_s=cost,
                                     ready_s=node.ready_s + cost, alternative_s=alternative))
    if not plans:
        return None, "; ".join(why_not)
    best = min(plans, key=lambda p: (p.ready_s, p.node_id))
    if alternative is not None and best.ready_s >= alternative - costs.min_gain_s:
        return None, (f"freeing a slot on {best.node_id} ({best.ready_s:.3g}s incl. {best.cost_s:.3g}s to migrate "
                      f"and stop) does not beat the best node with room ({alternative:.3g}s) by "
                      f"{costs.min_gain_s:.3g}s")
    return best, ""
