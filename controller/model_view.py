"""The controller's records of a model as the planner's view (`controller.model_plan.ModelView`).

Kept apart from the planner, which knows no `ModelState` or `ManagedInstance` (the simulator builds
the same view from its own cluster: `sim.thaw_policy.ThawPolicy`), and from the controller's tick,
which only asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from controller.managed_instance import ManagedInstance
from controller.model_plan import InstanceView, ModelView
from controller.model_state import ModelState
from wire import InstanceState

__all__ = ["model_view"]


def model_view(model: ModelState, live: Sequence[ManagedInstance], asleep: Sequence[ManagedInstance], *,
               num_ongoing_requests: int, num_queued_requests: int, keep_alive_floor_s: float) -> ModelView:
    """`model`'s view for this tick: `live` its loading and ready instances, `asleep` its sleepers."""
    return ModelView(
        model_id=model.model_id, policy=model.spec.autoscaling, autoscale_state=model.autoscale_state,
        num_desired_instances=model.num_desired_instances, num_ongoing_requests=num_ongoing_requests,
        num_queued_requests=num_queued_requests, last_request_s=model.last_request_s, restart_s=model.restart_s,
        keep_alive_floor_s=keep_alive_floor_s,
        instances=tuple(InstanceView(i.instance_id, i.phase is InstanceState.READY, i.num_ongoing_requests,
                                     i.started_s) for i in live),
        sleepers=tuple(InstanceView(i.instance_id, False, 0, i.started_s, i.asleep_s or 0.0) for i in asleep),
        next_start_s=model.next_start_s)
