"""A simulated policy by its name: the one module that knows all four.

Apart from `sim.policies` (the interface every policy imports) so that no policy module and the
interface import each other.
"""

from __future__ import annotations

from sim.policies import POLICY_NAMES, PolicySettings, SimPolicy, ThawAutoscaling
from sim.rayserve_policy import RayServePolicy
from sim.serverlessllm_policy import ServerlessLLMPolicy
from sim.thaw_policy import ThawPolicy
from sim.unbounded_policy import UnboundedPolicy

__all__ = ["make_policy"]


def make_policy(name: str, settings: PolicySettings, *, thaw_sharing=None,
                thaw_max_wait_before_preempt_s: float | None = None, thaw_autoscaling=None,
                thaw_activity_at_ticks: bool = False, thaw_spec: ThawAutoscaling | None = None,
                thaw_slot_reclaim: bool = True, thaw_slot_sharing: bool = True, thaw_sleep: bool = True) -> SimPolicy:
    """The policy called `name` (one of `POLICY_NAMES`). `thaw_sharing` (a controller
    `SlotSharingSettings`), `thaw_max_wait_before_preempt_s`, `thaw_autoscaling` (a whole
    controller `AutoscalingPolicy`), `thaw_activity_at_ticks`, `thaw_spec` (a `ThawAutoscaling`)
    `thaw_slot_reclaim`, `thaw_slot_sharing` and `thaw_sleep` configure Thaw's policy only (None /
    False / True / True / True: the controller's defaults, activity known at once)."""
    if name == "thaw":
        return ThawPolicy(settings, sharing=thaw_sharing, max_wait_before_preempt_s=thaw_max_wait_before_preempt_s,
                          autoscaling=thaw_autoscaling, activity_at_ticks=thaw_activity_at_ticks,
                          spec=thaw_spec, slot_reclaim=thaw_slot_reclaim, slot_sharing=thaw_slot_sharing,
                          sleep=thaw_sleep)
    if name == "serverlessllm":
        return ServerlessLLMPolicy(settings)
    if name == "rayserve":
        return RayServePolicy(settings)
    if name == "unbounded":
        return UnboundedPolicy(settings)
    raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICY_NAMES)}")
