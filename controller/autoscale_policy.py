"""The autoscaling decision for one model: a pure function of a load snapshot and explicit state.

``decide(policy, snapshot, state, now) -> (ScaleDecision, AutoscaleState)`` does no I/O and
reads no clock: `now` is passed in and every memory of the past is in `AutoscaleState`. So the
decision is unit-tested with plain numbers, replayed by a simulator, and survives a
controller restart when the state is saved (a lost state only makes the next move wait its
delay again, it never makes a wrong move).

The rule (after Ray Serve's and ServerlessLLM's):

1. demand = ongoing + queued requests: a queued request is one a new instance would serve.
2. desired = ceil(demand / target_ongoing_requests), clamped to [min_instances, max_instances].
3. A model with no instance and some demand starts at once, no delay: that request is
   waiting on a cold start, and a delay would only add to it.
4. Otherwise a change must persist: more instances only after the wish for more has lasted
   `upscale_delay_s`, fewer only after `downscale_delay_s` (hysteresis, as Ray Serve's
   consecutive-decision counter). The change applied is the desire at that moment.
5. Zero demand keeps one instance warm until the model has been idle its keep-alive; then it
   scales to zero (only when min_instances == 0). Idle means no ongoing or queued request
   since the snapshot's `last_request_s`. The keep-alive (`keep_alive_for`) is the policy's
   `keep_alive_s`, or, with `keep_alive_per_restart`, that multiple of the snapshot's
   `restart_s` within [min_keep_alive_s, max_keep_alive_s]: holding an idle instance is worth
   what its restart would cost, and that cost grows with the restart time (a ski-rental rule,
   weighted towards holding because a restart costs the waiting user too, not only the slot).
   The snapshot may raise it to `keep_alive_floor_s`: while slots are contended the controller
   gives no idle instance back sooner (issue 39). Then the freed slot saves no accelerator time,
   as the next waiting model takes it at once, and it goes past the eviction policy's judgement
   of who should have it; an idle instance kept is still evicted for a waiting model when that
   policy says so.
6. A count outside [min, max] (the spec was just changed) is moved to the nearest bound at
   once: those are limits, not load signals to smooth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controller.model_spec import AutoscalingPolicy


@dataclass(frozen=True, kw_only=True)
class LoadSnapshot:
    """What the controller saw of one model at one reconcile tick.

    Fields:
        num_instances: instances that exist (starting or ready).
        num_ongoing_requests: requests in flight on those instances, summed.
        num_queued_requests: requests waiting at the gateway for an instance.
        last_request_s: when a request was last seen (arrived or finished), on the clock of
            `now`; None if the model has not served since the controller started.
        restart_s: the model's estimated restart time (`TierBandwidths.restart_s`), seconds;
            None when unknown (no instance placed since the controller started): the keep-alive
            is then the longest a `keep_alive_per_restart` policy allows.
        keep_alive_floor_s: the least keep-alive the controller allows now (0: none); see the
            module docstring, rule 5.
    """

    num_instances: int
    num_ongoing_requests: int = 0
    num_queued_requests: int = 0
    last_request_s: float | None = None
    restart_s: float | None = None
    keep_alive_floor_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_instances", "num_ongoing_requests", "num_queued_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        restart = self.restart_s
        if restart is not None and (isinstance(restart, bool) or not isinstance(restart, (int, float))
                                    or not math.isfinite(restart) or restart < 0):
            raise ValueError(f"restart_s must be a finite number >= 0 or None, got {restart!r}")
        floor = self.keep_alive_floor_s
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not math.isfinite(floor) or floor < 0:
            raise ValueError(f"keep_alive_floor_s must be a finite number >= 0, got {floor!r}")

    @property
    def num_demand_requests(self) -> int:
        return self.num_ongoing_requests + self.num_queued_requests


@dataclass(frozen=True)
class AutoscaleState:
    """The policy's memory between ticks.

    Fields:
        wish_direction: +1 while more instances are wanted, -1 while fewer, 0 when content.
        wish_since_s: when the current wish began; the up/down delays count from here.
        idle_since_s: when the policy first saw zero demand with no `last_request_s` to go by,
            so an instance that never served still reaches its keep-alive.
    """

    wish_direction: int = 0
    wish_since_s: float | None = None
    idle_since_s: float | None = None


@dataclass(frozen=True)
class ScaleDecision:
    """What to do now.

    Fields:
        num_instances: the count to have now (equal to the snapshot's when holding).
        num_desired_instances: what the load asks for, before the delays.
        reason: one line for logs and ``thaw status``.
    """

    num_instances: int
    num_desired_instances: int
    reason: str


def keep_alive_for(policy: AutoscalingPolicy, restart_s: float | None, floor_s: float = 0.0) -> float:
    """How long an idle model keeps its last instance: `keep_alive_s`, or with
    `keep_alive_per_restart` that multiple of `restart_s` within [min_keep_alive_s,
    max_keep_alive_s] (None restart: max_keep_alive_s, the cautious end: a model whose restart
    is unknown may be one that restarts slowly); at least `floor_s` (`LoadSnapshot.keep_alive_floor_s`)."""
    return max(floor_s, _spec_keep_alive_s(policy, restart_s))


def _spec_keep_alive_s(policy: AutoscalingPolicy, restart_s: float | None) -> float:
    factor = policy.keep_alive_per_restart
    if factor is None:
        return policy.keep_alive_s
    if restart_s is None:
        return policy.max_keep_alive_s
    return min(policy.max_keep_alive_s, max(policy.min_keep_alive_s, factor * restart_s))


def _keep_alive_text(policy: AutoscalingPolicy, restart_s: float | None, keep_alive_s: float) -> str:
    if keep_alive_s > _spec_keep_alive_s(policy, restart_s):
        return f"keep-alive {keep_alive_s:g}s (the floor while slots are contended)"
    if policy.keep_alive_per_restart is None:
        return f"keep_alive_s {keep_alive_s:g}"
    restart = "unknown" if restart_s is None else f"{restart_s:.3g}s"
    return f"keep-alive {keep_alive_s:.3g}s ({policy.keep_alive_per_restart:g} x restart {restart})"


def desired_instances(policy: AutoscalingPolicy, num_demand_requests: int) -> int:
    """ceil(demand / target), clamped to [min_instances, max_instances]."""
    raw = math.ceil(num_demand_requests / policy.target_ongoing_requests)
    return max(policy.min_instances, min(policy.max_instances, raw))


def decide(
    policy: AutoscalingPolicy, snapshot: LoadSnapshot, state: AutoscaleState, now: float
) -> tuple[ScaleDecision, AutoscaleState]:
    """One tick of the autoscaler for one model; see the module docstring for the rule."""
    current = snapshot.num_instances
    demand = snapshot.num_demand_requests
    desired = desired_instances(policy, demand)

    idle_since = state.idle_since_s
    if demand > 0:
        idle_since = None
    elif idle_since is None:
        idle_since = now

    if current < policy.min_instances or current > policy.max_instances:
        bounded = max(policy.min_instances, min(policy.max_instances, current))
        bound = "min_instances" if current < policy.min_instances else "max_instances"
        return (
            ScaleDecision(bounded, desired, f"{current} -> {bounded}: outside [{policy.min_instances}, "
                          f"{policy.max_instances}] ({bound} changed)"),
            AutoscaleState(idle_since_s=idle_since),
        )

    if current == 0:
        if demand == 0:
            return ScaleDecision(0, 0, "scaled to zero, no requests"), AutoscaleState(idle_since_s=idle_since)
        return (
            ScaleDecision(desired, desired, f"cold start 0 -> {desired}: {demand} requests and no instance "
                          f"(ceil({demand}/{policy.target_ongoing_requests:g}))"),
            AutoscaleState(),
        )

    idle_s = 0.0
    keep_alive_s = keep_alive_for(policy, snapshot.restart_s, snapshot.keep_alive_floor_s)
    if demand == 0:
        idle_from = snapshot.last_request_s if snapshot.last_request_s is not None else idle_since
        idle_s = max(0.0, now - idle_from)
        if policy.min_instances == 0 and idle_s >= keep_alive_s:
            return (
                ScaleDecision(0, 0, f"scale to zero {current} -> 0: idle {idle_s:g}s >= "
                              f"{_keep_alive_text(policy, snapshot.restart_s, keep_alive_s)}"),
                AutoscaleState(idle_since_s=idle_since),
            )
        # Keep one instance warm until the keep-alive runs out: a scale to zero here would
        # make the next request pay the cold start that the keep-alive exists to avoid.
        desired = max(desired, 1)

    if desired == current:
        reason = f"steady at {current}"
        if demand == 0 and policy.min_instances == 0:
            reason += f": idle {idle_s:g}s of {_keep_alive_text(policy, snapshot.restart_s, keep_alive_s)}"
        return ScaleDecision(current, desired, reason), AutoscaleState(idle_since_s=idle_since)

    direction = 1 if desired > current else -1
    delay_s = policy.upscale_delay_s if direction > 0 else policy.downscale_delay_s
    delay_name = "upscale_delay_s" if direction > 0 else "downscale_delay_s"
    since = state.wish_since_s if state.wish_direction == direction and state.wish_since_s is not None else now
    waited_s = now - since
    verb = "scale up" if direction > 0 else "scale down"
    load = f"{demand} requests / target {policy.target_ongoing_requests:g}"
    if waited_s >= delay_s:
        return (
            ScaleDecision(desired, desired, f"{verb} {current} -> {desired}: {load} for {waited_s:g}s >= "
                          f"{delay_name} {delay_s:g}"),
            AutoscaleState(idle_since_s=idle_since),
        )
    return (
        ScaleDecision(current, desired, f"holding {current}: want {desired} ({load}) for {waited_s:g}s of "
                      f"{delay_name} {delay_s:g}"),
        AutoscaleState(wish_direction=direction, wish_since_s=since, idle_since_s=idle_since),
    )
