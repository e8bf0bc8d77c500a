"""Carrying out slot reclaims: `SlotReclaimer` between placement's decision and the start.

`controller.slot_reclaim_policy.plan_slot_reclaim` says when a cold model is better served by
emptying an instance on a full node than by the nodes with room. This runs the plan and holds the
slot for the model until it is free:

1. `steer` is asked with placement's decision for every instance the controller is about to
   place. A plan it adopts takes the victim out of routing at once (`InstanceManager.begin_stop`,
   which drains it) and live-migrates its running requests to another instance of its model
   (`RequestMover.move_off`, the same loop a node drain runs), records the plan as a decision
   (``thaw status``, the log) and answers "wait": nothing is started this tick.
2. While a reclaim is pending, the model waits for that node: as soon as the node has room, the
   instance is placed there (and only there); its hold (`holds`, `controller.slot_holds`) keeps every other model's
   placement from taking the slot meanwhile (the emptied model's own replacement included).
3. If the slot is not free by the deadline (drain timeout + the plan's cost), the reclaim is
   given up (recorded) and the model is placed as if it had never been planned; so it is when
   the model no longer wants the instance (scaled back down, deleted).

Requests never get lost here: a migration that fails leaves its request on the victim, which the
drain lets finish (up to the drain timeout) before it stops -- the same guarantee as a node drain.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from controller.control_context import ControlContext
from controller.controller_config import ControllerConfig
from controller.instance_manager import InstanceManager
from controller.model_state import ModelState
from controller.slot_holds import SlotHold
from controller.placement_policy import NodeView, PlacementDecision, place
from controller.request_mover import RequestMover
from controller.slot_reclaim_policy import SlotReclaimPlan, plan_slot_reclaim
from wire import InstanceState

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Pending:
    plan: SlotReclaimPlan
    num_slots: int
    started_s: float  # controller clock
    deadline_s: float
    memory_bytes: int = 0  # of the node's worker memory budget, held for the model


class SlotReclaimer:
    """See the module docstring. Runs on the controller's event loop."""

    def __init__(self, config: ControllerConfig, instances: InstanceManager, mover: RequestMover, *,
                 draining_nodes: Callable[[], set[str]], context: ControlContext) -> None:
        self.config = config
        self._instances = instances
        self._mover = mover
        self._draining_nodes = draining_nodes
        self._record = context.record
        self._wall_clock = context.wall_clock
        self._background = context.background
        self._pending: dict[str, _Pending] = {}  # model id -> the reclaim holding a slot for it

    def holds(self) -> list[tuple[str, SlotHold]]:
        """(model id, the slot held for it) for each pending reclaim (`controller.slot_holds`)."""
        return [(model_id, SlotHold(p.plan.node_id, p.num_slots, p.memory_bytes))
                for model_id, p in self._pending.items()]

    def pending(self) -> list[dict[str, Any]]:
        """The reclaims under way, for ``thaw status``."""
        return [p.plan.to_dict() | {"num_slots": p.num_slots} for p in self._pending.values()]

    def forget(self, model_id: str, why: str) -> None:
        """The model no longer needs the slot (deleted, scaled down): it is free for others."""
        pending = self._pending.pop(model_id, None)
        if pending is not None:
            self._abandoned(model_id, pending, why)

    def _abandoned(self, model_id: str, pending: _Pending, why: str) -> None:
        self._record({"kind": "slot_reclaim_abandoned", "model_id": model_id, "node_id": pending.plan.node_id,
                      "reason": why, "at_s": self._wall_clock()})
        logger.warning("%s: giving up the slot reclaim on %s: %s", model_id, pending.plan.node_id, why)

    def steer(self, model: ModelState, decision: PlacementDecision, views: Sequence[NodeView], num_slots: int,
              now: float, memory_bytes: int = 0) -> PlacementDecision | None:
        """The decision to act on for one more instance of `model` (placement's, or one restricted
        to the node a reclaim freed), or None: wait, a slot is being freed for it. `memory_bytes`:
        what the instance takes of a node's worker memory budget."""
        model_id = model.model_id
        pending = self._pending.get(model_id)
        if pending is not None:
            view = next((v for v in views if v.node_id == pending.plan.node_id), None)
            freed = None if view is None else place(model.num_bytes, [view], num_slots, memory_bytes)
            if freed is not None and freed.placed:
                del self._pending[model_id]
                return freed
            if now < pending.deadline_s and view is not None:
                return None
            del self._pending[model_id]
            why = ("the node is gone" if view is None else
                   f"the slot was not free {now - pending.started_s:.3g}s after the victim was stopped")
            self._abandoned(model_id, pending, f"{why}; placing as usual")
            return decision
        if self.config.slot_reclaim is None:
            return decision
        plan, why = plan_slot_reclaim(model_id, decision, self._instances.all(), self._draining_nodes(),
                                      self.config.slot_reclaim, num_slots)
        if plan is None:
            if not decision.placed and why:
                return dataclasses.replace(decision, reason=f"{decision.reason}; no slot to reclaim: {why}")
            return decision
        victim = self._instances.get(plan.victim_instance_id)
        if victim is None or victim.phase is not InstanceState.READY:
            return decision  # raced with a stop: the next tick plans again
        self._instances.begin_stop(victim, f"slot reclaimed for {model_id}", self.config.drain_timeout_s)
        if plan.num_requests and victim.handle is not None:
            task = asyncio.get_running_loop().create_task(self._mover.move_off(victim))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        self._pending[model_id] = _Pending(plan, num_slots, now, now + self.config.drain_timeout_s + plan.cost_s,
                                           memory_bytes)
        self._record({"kind": "slot_reclaim", **plan.to_dict(), "at_s": self._wall_clock()})
        logger.info("%s: %s", model_id, plan.describe())
        return None
