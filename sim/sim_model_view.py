"""A simulated model as the controller's planner sees it (`controller.model_plan.ModelView`).

The simulator's side of `controller.model_view`: the same view, built from the simulated
cluster's model state instead of the controller's records, so that `plan_model` plans a
simulated tick exactly as it plans a real one.
"""

from __future__ import annotations

from controller import AutoscaleState, AutoscalingPolicy, InstanceView, ModelView
from wire import InstanceState

__all__ = ["sim_model_view"]


def sim_model_view(state, policy: AutoscalingPolicy, autoscale_state: AutoscaleState, num_desired_instances: int, *,
                   last_request_s: float | None, restart_s: float | None, keep_alive_floor_s: float) -> ModelView:
    """`state` (a `sim.sim_model_state.SimModelState`): its instances and sleepers, its load; the
    rest is what the policy keeps per model (`ThawPolicy`'s `_ModelControl`) and the settings. No
    start back-off: a simulated start does not fail."""
    return ModelView(
        model_id=state.model_id, policy=policy, autoscale_state=autoscale_state,
        num_desired_instances=num_desired_instances, num_ongoing_requests=state.num_ongoing,
        num_queued_requests=len(state.queue), last_request_s=last_request_s, restart_s=restart_s,
        keep_alive_floor_s=keep_alive_floor_s,
        instances=tuple(InstanceView(i.instance_id, i.phase == InstanceState.READY, i.num_ongoing, i.started_s)
                        for i in state.instances),
        sleepers=tuple(InstanceView(i.instance_id, False, 0, i.started_s, i.asleep_s) for i in state.sleepers))
