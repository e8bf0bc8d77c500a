"""One planner for a model's tick, for both the controller and the simulator.

Each reconcile tick asks, per model: what count does its load want now (the autoscaler, `decide`),
and how does the model get there from the instances it has? `plan_model(view, now)` answers both
from a `ModelView` (what the tick sees of the model) with a `ModelPlan` (what to do), a pure
function in the style of Ray Serve's ``DeploymentState.update()`` returning what to scale. The
controller carries the plan out through its cluster (`Controller._autoscale_model`), the
simulator through its simulated cluster (`sim.thaw_policy.ThawPolicy`): the rules are written
here once, never again in either (issue 40: the simulator used to re-implement them by hand).

The rules, in the order applied:

- the count: `decide` over the view's load; `num_desired_instances` becomes its answer;
- too many live instances: the extra ones scale down in the stop order (one still loading first,
  it serves nobody yet; then the least busy; then the newest), each put to sleep where it may
  or stopped (the executor's `InstanceSleep` knows which);
- too few: the missing ones come first from the model's sleepers, the one asleep the longest
  first (it is the next to lose its host memory to a newer sleeper; ties in the view's order),
  the rest placed anew, unless the model's start back-off (`next_start_s`, after failed starts)
  still runs;
- none missing: a slot held or being freed for the model is released (`releases_holds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controller.autoscale_policy import AutoscaleState, AutoscalingPolicy, LoadSnapshot, ScaleDecision, decide

__all__ = ["InstanceView", "ModelPlan", "ModelView", "plan_model", "stop_order_key"]


@dataclass(frozen=True)
class InstanceView:
    """What the plan reads of one of the model's instances."""

    instance_id: str
    ready: bool  # serving (else loading, or asleep for a sleeper)
    num_ongoing_requests: int
    started_s: float  # when it was started: the newest stops first among equals
    asleep_s: float = 0.0  # a sleeper's: when it fell asleep

    def __post_init__(self) -> None:
        if self.num_ongoing_requests < 0:
            raise ValueError(f"instance {self.instance_id}: num_ongoing_requests must be >= 0")


def stop_order_key(instance: InstanceView) -> tuple[bool, int, float]:
    """Which instance to stop first when scaling down: one still loading (it serves nobody yet),
    then the least busy, then the newest."""
    return (instance.ready, instance.num_ongoing_requests, -instance.started_s)


@dataclass(frozen=True)
class ModelView:
    """What one tick sees of a model: its policy and the autoscaler's memory, its load (what
    `LoadSnapshot` takes), its live instances (loading or ready) and its sleepers."""

    model_id: str
    policy: AutoscalingPolicy
    autoscale_state: AutoscaleState
    num_desired_instances: int  # the count decided last
    num_ongoing_requests: int
    num_queued_requests: int
    last_request_s: float | None
    restart_s: float | None  # its restart estimate (the keep-alive per restart is a multiple of it)
    keep_alive_floor_s: float  # the floor while slots are contended (`SlotSharingSettings`)
    instances: tuple[InstanceView, ...]
    sleepers: tuple[InstanceView, ...] = ()
    next_start_s: float = -math.inf  # no start before this (back-off after failed starts)

    def snapshot(self) -> LoadSnapshot:
        return LoadSnapshot(num_instances=self.num_desired_instances, num_ongoing_requests=self.num_ongoing_requests,
                            num_queued_requests=self.num_queued_requests, last_request_s=self.last_request_s,
                            restart_s=self.restart_s, keep_alive_floor_s=self.keep_alive_floor_s)


@dataclass(frozen=True)
class ModelPlan:
    """What to do with one model this tick (see the module docstring). The executor scales down
    `scale_down`, then wakes sleepers in `wake_order` until `num_missing` are woken (one whose
    node has no room for it any more is stopped instead), then, if `may_place`, places the rest."""

    decision: ScaleDecision
    previous_count: int  # the view's count, before this decision
    autoscale_state: AutoscaleState
    scale_down: tuple[str, ...]  # instance ids, in the stop order
    num_missing: int  # instances wanted beyond the live ones
    wake_order: tuple[str, ...]  # sleepers' ids, the one to wake first first
    may_place: bool  # False while the start back-off runs
    releases_holds: bool  # the model has (at least) its instances: holds for it are released

    @property
    def num_desired_instances(self) -> int:
        return self.decision.num_instances

    @property
    def changes_count(self) -> bool:
        """Whether the decided count differs from the view's (the controller stores it durably)."""
        return self.decision.num_instances != self.previous_count


def plan_model(view: ModelView, now: float) -> ModelPlan:
    """This tick's plan for the model (see the module docstring)."""
    decision, state = decide(view.policy, view.snapshot(), view.autoscale_state, now)
    missing = decision.num_instances - len(view.instances)
    scale_down = tuple(i.instance_id for i in sorted(view.instances, key=stop_order_key)[:max(0, -missing)])
    wake_order = tuple(s.instance_id for s in sorted(view.sleepers, key=lambda s: s.asleep_s)) \
        if missing > 0 else ()
    return ModelPlan(decision=decision, autoscale_state=state, scale_down=scale_down, num_missing=max(0, missing),
                     wake_order=wake_order, may_place=now >= view.next_start_s, releases_holds=missing <= 0,
                     previous_count=view.num_desired_instances)
