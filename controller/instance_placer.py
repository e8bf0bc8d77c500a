"""Placing one instance of a model: `InstancePlacer`, the last step of converging a model.

The tick (`Controller._converge`) asks for one instance at a time, as many as its model is
short of. One ask goes, in order: the tenant's ``max_instances`` quota (a tenant at its quota does
not grow, before any eviction or reclaim); the nodes of the model's kind (GPU models on GPU
nodes); a `NodeView` per node with other models' held slots taken out (`views`, also what waking
a sleeper sees); `place`; then slot sharing steers an unplaced model (`SlotSharer.steer`:
evict idle instances; `SlotReclaimer.steer`: migrate requests off; `SlotSharer.preempt`: take a
busy slot past a bounded wait), and a GPU host that must be warm and have room is checked
(`InstanceManager.gpu_host_refusal`). Only then does `InstanceManager.start` take the slot.

Split out of `controller.Controller` so that the tick reads as its steps; the placer owns the
model's ``last_placement`` record (what ``thaw status`` shows as the placement reason) and writes
a refusal to the decision log only when its first clause changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from controller.control_context import ControlContext
from controller.cluster_node import ClusterNode, has_worker_memory_budget, node_view, nodes_of_kind
from controller.controller_config import ControllerConfig
from controller.controller_status import placement_to_dict
from controller.engine_settings import instance_kv_bytes, instance_memory_bytes
from controller.instance_manager import InstanceManager
from controller.model_state import ModelState
from controller.slot_holds import views_past_holds
from controller.placement_policy import NodeView, PlacementDecision, place
from controller.slot_reclaimer import SlotReclaimer
from controller.slot_sharer import SlotSharer
from controller.tenant_quota import TenantQuota, instances_over_quota

__all__ = ["InstancePlacer"]

logger = logging.getLogger(__name__)


class InstancePlacer:
    """See the module docstring. `quota(tenant)`: the tenant's quota (`ModelRegistry.quota`);
    `context`: the clocks and the decision log (`ControlContext`)."""

    def __init__(self, config: ControllerConfig, instances: InstanceManager, nodes: Mapping[str, ClusterNode], *,
                 sharer: SlotSharer, reclaimer: SlotReclaimer, quota: Callable[[str], TenantQuota],
                 context: ControlContext) -> None:
        self.config = config
        self._instances = instances
        self._nodes = nodes
        self._sharer = sharer
        self._reclaimer = reclaimer
        self._quota = quota
        self._record = context.record
        self._wall_clock = context.wall_clock

    def views(self, model: ModelState, nodes: list[ClusterNode], now: float) -> list[NodeView]:
        """Placement's view of `nodes` for `model`: what other models' held slots leave there."""
        instances = self._instances.all()
        return views_past_holds([node_view(node, model.repository_name, instances, self.config, now) for node in nodes],
                                [*self._reclaimer.holds(), *self._sharer.holds()], model.model_id)

    def place_and_start(self, model: ModelState, now: float) -> bool:
        """Choose a node and start one instance there; False if no node has room, or the model's
        tenant is at its ``max_instances`` quota."""
        spec = model.spec
        instances = self._instances.all()
        num_tenant_instances = sum(i.serving and i.model_id.partition("/")[0] == spec.tenant for i in instances)
        refusal = instances_over_quota(spec.tenant, self._quota(spec.tenant), num_tenant_instances)
        if refusal is not None:  # before any eviction or reclaim: a tenant at its quota does not grow
            self._record_unplaced(model, PlacementDecision(None, None, None, (), refusal))
            return False
        connected = sorted((n for n in self._nodes.values() if n.store is not None), key=lambda n: n.node_id)
        nodes, wrong_kind = nodes_of_kind(spec.resources.num_gpus, connected)  # GPU models on GPU nodes only
        num_slots = spec.resources.num_worker_slots
        memory = 0
        if any(has_worker_memory_budget(node, self.config) for node in nodes):
            memory = instance_memory_bytes(spec, model.num_bytes, self.config)
        views = self.views(model, nodes, now)
        decision = (place(model.num_bytes, views, num_slots, memory) if views else
                    PlacementDecision(None, None, None, (), wrong_kind or "no node with a connected store yet"))
        # Free slot (and memory), else idle instances evicted until it fits, else requests migrated
        # off (a reclaim), else past the model's bounded wait a busy instance preempted; None: a
        # slot is being freed.
        decision = self._sharer.steer(model, decision, views, num_slots, now, memory)
        if decision is not None:
            decision = self._reclaimer.steer(model, decision, views, num_slots, now, memory)
        if decision is not None:
            decision = self._sharer.preempt(model, decision, num_slots, now, memory)
        if decision is None:
            return False
        if not decision.placed:
            self._record_unplaced(model, decision)
            return False
        refusal = self._instances.gpu_host_refusal(model, self._nodes[decision.node_id], memory)
        if refusal is not None:  # a GPU shared by memory: the model waits for a warm host with room
            self._record_unplaced(model, PlacementDecision(None, None, None, (), refusal))
            return False
        draining = {n.node_id for n in connected if n.draining}
        chosen = next((v for v in views if v.node_id == decision.node_id), None)
        if chosen is not None and model.num_bytes is not None:
            model.restart_s = chosen.bandwidths.restart_s(model.num_bytes)
        instance = self._instances.start(model, self._nodes[decision.node_id], decision.estimate_s, now,
                                         tier=decision.tier, draining_node_ids=draining, memory_bytes=memory,
                                         kv_memory_bytes=instance_kv_bytes(spec, self.config) if memory else 0)
        model.last_placement = placement_to_dict(model.model_id, decision, self._wall_clock(), instance.instance_id)
        self._record(model.last_placement)
        logger.info("%s: starting %s: %s", model.model_id, instance.instance_id, decision.reason)
        return True

    def _record_unplaced(self, model: ModelState, decision: PlacementDecision) -> None:
        """Keeps the latest refusal for ``thaw status``; logs and records it only when its first
        clause changes: what follows it (why no idle instance could be evicted, how long the model
        has waited of its preemption bound) changes every tick and would flood the log."""
        unplaced = placement_to_dict(model.model_id, decision, self._wall_clock())
        previous = model.last_placement
        if previous is None or previous["node_id"] is not None or \
                previous["reason"].split("; ")[0] != decision.reason.split("; ")[0]:
            logger.info("%s: cannot place: %s", model.model_id, decision.reason)  # once, not every tick
            self._record(unplaced)
        model.last_placement = unplaced
