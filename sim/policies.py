"""The policies a simulation compares: the `SimPolicy` interface, their settings and their names
(`sim.policy_factory.make_policy` builds one by name).

A policy is the controller of a simulated cluster. The cluster calls it back when something
happens to a model (a request queued, demand changed, an instance ready, idle or gone) and the
`TickScheduler` calls `tick(now)` when it asked for one; in `tick` it decides and acts through
the cluster's public methods (`start_instance`, `stop_instance`, `evict`, `suspend`, `migrate`).

Scale (10,000 models, 1,000 nodes): a tick looks only at *dirty* models -- those something
happened to since the last tick, those whose timer (a keep-alive, a scale delay) ran out, and
those still waiting for a slot -- never at all of them. The base class keeps that bookkeeping;
subclasses say which changes matter (`on_demand` marks a model dirty only when its demand could
change its instance count).

- `thaw` (`sim.thaw_policy`): the controller's own policy functions, called unchanged.
- `serverlessllm` (`sim.serverlessllm_policy`): locality-aware loading, keep-alive, no eviction.
- `rayserve` (`sim.rayserve_policy`): Ray Serve's autoscaler defaults, locality-blind, from S3.
- `unbounded` (`sim.unbounded_policy`): the lower bound.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

__all__ = ["POLICY_NAMES", "PolicySettings", "SimPolicy", "THAW_SHARING", "ThawAutoscaling"]

POLICY_NAMES = ("thaw", "serverlessllm", "rayserve", "unbounded")


@dataclass(frozen=True, kw_only=True)
class PolicySettings:
    """What every policy is given alike, so they differ only in how they decide.

    Fields:
        target_ongoing_requests: requests one instance should carry (each policy's autoscaler
            wants ceil(demand / target) instances).
        max_instances: the most instances of one model.
        keep_alive_s: how long thaw and serverlessllm keep an idle instance (Ray Serve uses its
            own downscale delay instead).
    """

    target_ongoing_requests: float = 16.0
    max_instances: int = 8
    keep_alive_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.target_ongoing_requests, (int, float)) or not math.isfinite(self.target_ongoing_requests) \
                or self.target_ongoing_requests <= 0:
            raise ValueError(f"PolicySettings.target_ongoing_requests must be a number > 0, "
                             f"got {self.target_ongoing_requests!r}")
        if not isinstance(self.max_instances, int) or isinstance(self.max_instances, bool) or self.max_instances < 1:
            raise ValueError(f"PolicySettings.max_instances must be an integer >= 1, got {self.max_instances!r}")
        if not isinstance(self.keep_alive_s, (int, float)) or not math.isfinite(self.keep_alive_s) \
                or self.keep_alive_s < 0:
            raise ValueError(f"PolicySettings.keep_alive_s must be a number >= 0, got {self.keep_alive_s!r}")


@dataclass(frozen=True, kw_only=True)
class ThawAutoscaling:
    """The model-spec autoscaling settings Thaw's policy is deployed with on a simulated GPU
    cluster, beyond what `PolicySettings` gives every policy alike; None: the controller's default
    (`controller.AutoscalingPolicy`: fixed keep-alive, upscale 1 s, downscale 30 s, which suit its
    CPU nodes).

    The defaults, chosen on 10,000 models x 1,000 nodes x 4 h, seed 0, and checked on the 24 h run
    (BENCHMARKS.md, issue 24): an idle model kept 30 x its restart time (10-180 s), a wish for more
    instances acted on at once (ServerlessLLM's peer does too), and extra instances kept 600 s after
    the load that wanted them passed (ServerlessLLM's peer keeps them until the model is idle):
    a burst's extra instance given back after 30 s often came back on a node without the
    checkpoint, from the repository.

    Fields:
        keep_alive_per_restart: the spec's `keep_alive_per_restart` (None: the fixed keep-alive).
        upscale_delay_s / downscale_delay_s: the spec's delays.
    """

    keep_alive_per_restart: float | None = 30.0
    upscale_delay_s: float | None = 0.0
    downscale_delay_s: float | None = 600.0

    def __post_init__(self) -> None:
        for name in ("keep_alive_per_restart", "upscale_delay_s", "downscale_delay_s"):
            value = getattr(self, name)
            low_ok = name != "keep_alive_per_restart"
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0 or (value == 0 and not low_ok)):
                raise ValueError(f"ThawAutoscaling.{name} must be a finite number {'>=' if low_ok else '>'} 0 or "
                                 f"None (the controller's default), got {value!r}")

    @classmethod
    def controller_defaults(cls) -> "ThawAutoscaling":
        return cls(keep_alive_per_restart=None, upscale_delay_s=None, downscale_delay_s=None)

    def spec_fields(self) -> dict[str, float]:
        """The `AutoscalingPolicy` fields these set (those not None)."""
        return {name: value for name, value in (("keep_alive_per_restart", self.keep_alive_per_restart),
                                                ("upscale_delay_s", self.upscale_delay_s),
                                                ("downscale_delay_s", self.downscale_delay_s)) if value is not None}


def _thaw_sharing():
    from controller import SlotSharingSettings

    return SlotSharingSettings(contended_keep_alive_s=60.0)


# The controller config's slot sharing a GPU deployment would use: the controller's defaults, with
# the keep-alive floor while slots are contended on (60 s; off by default, which suits CPU nodes
# whose restarts take seconds). On the contended scenario it took the mean SLO attainment of
# seeds 0-9 from 0.744 to 0.768 and left the medium and full scale unchanged (BENCHMARKS.md).
THAW_SHARING = _thaw_sharing()


class SimPolicy:
    """Base of the four: the dirty set, timers and cluster callbacks (see the module docstring)."""

    name = "base"
    keeps_node_copies = True  # the cluster keeps checkpoints in node DRAM/SSD after a load

    def __init__(self, settings: PolicySettings) -> None:
        self.settings = settings
        self.cluster = None
        self.ticks = None
        self.dirty: set[int] = set()
        self.waiting: set[int] = set()  # models with queued requests (retried every tick)
        self._timers: list[tuple[float, int]] = []
        self._instances_by_demand: list[int] = []

    def attach(self, cluster, ticks) -> None:
        self.cluster = cluster
        self.ticks = ticks

    def instances_for(self, demand: int) -> int:
        """ceil(demand / target_ongoing_requests), at most max_instances: remembered per demand,
        since it is asked on every request's arrival and finish."""
        known = self._instances_by_demand
        while len(known) <= demand:
            known.append(min(self.settings.max_instances,
                             math.ceil(len(known) / self.settings.target_ongoing_requests)))
        return known[demand]

    # --- bookkeeping -------------------------------------------------------------------------

    def mark(self, model_index: int) -> None:
        """The model needs a look at the next grid tick."""
        if model_index not in self.dirty:
            self.dirty.add(model_index)
            self.ticks.wake_next()

    def wake_model_at(self, model_index: int, time_s: float) -> None:
        """Look at the model again at `time_s` (a timer)."""
        heapq.heappush(self._timers, (time_s, model_index))
        self.ticks.wake_at(time_s)

    def take_dirty(self, now: float, stale=None, waiting=None) -> list[int]:
        """The models to look at in this tick, in index order: dirty, timed out, or waiting (those
        of `waiting`, default all). `stale(model_index, now)`: True for a timer that no longer
        matters (skipped)."""
        timers = self._timers
        models = self.dirty | (self.waiting if waiting is None else waiting)
        while timers and timers[0][0] <= now + 1e-9:
            index = heapq.heappop(timers)[1]
            if index not in models and (stale is None or not stale(index, now)):
                models.add(index)
        self.dirty = set()
        return sorted(models)

    # --- cluster callbacks -------------------------------------------------------------------

    def on_queued(self, state) -> None:
        """Requests of the model wait in its queue: wake the controller now (the gateway does)."""
        if state.index not in self.waiting:
            self.waiting.add(state.index)
            self.ticks.wake_now()

    def on_demand(self, state) -> None:
        """The model's ongoing or queued count changed."""

    def on_started(self, state, now: float) -> None:
        """A request of the model was handed to an instance."""

    def on_ready(self, instance) -> None:
        self.mark(instance.model_index)

    def on_idle(self, instance) -> None:
        self.mark(instance.model_index)

    def on_released(self, instance) -> None:
        """An instance is gone: its slots are free, so a model waiting for one may go now."""
        self.mark(instance.model_index)
        if self.waiting:
            self.ticks.wake_next()

    # --- the controller ----------------------------------------------------------------------

    def tick(self, now: float) -> None:
        raise NotImplementedError

    def counts(self) -> dict[str, int]:
        """Policy-specific counters for the result."""
        return {}

    def describe(self) -> dict[str, object]:
        """Policy-specific settings for the result (what a run was configured with)."""
        return {}
