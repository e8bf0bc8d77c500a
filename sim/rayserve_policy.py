"""A Ray-Serve-like policy: Ray Serve's default autoscaler, locality-blind, loading from the repository.

Ray Serve's `AutoscalingConfig` defaults (checked against the installed ray 2.60,
`ray/serve/config.py` and `ray/serve/autoscaling_policy.py`, and docs.ray.io's AutoscalingConfig
page): `upscale_delay_s` 30, `downscale_delay_s` 600, `downscale_to_zero_delay_s` None (the
downscale delay), `min_replicas` here 0 (scale to zero). The rule, as its
`replica_queue_length_autoscaling_policy` with its default delay logic:

- desired = ceil(total requests / target_ongoing_requests), within [0, max_instances];
- from zero replicas with requests: scale up at once (Ray Serve's cold-start fast path bypasses
  the delay);
- otherwise a wish to scale up must hold for `upscale_delay_s`, a wish to scale down for
  `downscale_delay_s` (a wish that changes direction starts over);
- Ray Serve averages its metrics over `look_back_period_s`; the simulator uses the current
  count (a stated simplification that favours Ray Serve).

Placement is Ray's scheduler's: any node with a free GPU, blind to where checkpoints are
(`controller.place_locality_blind`, the most free slots first), and a replica always loads its
weights from the model repository (S3): no node copy is kept or used. No eviction, no
preemption, no migration: a replica that finds no free GPU stays pending until one frees.
"""

from __future__ import annotations

from controller import place_locality_blind
from sim.node_views import NodeViews
from sim.policies import PolicySettings, SimPolicy
from wire import InstanceState

__all__ = ["RAY_SERVE_DOWNSCALE_DELAY_S", "RAY_SERVE_UPSCALE_DELAY_S", "RayServePolicy"]

RAY_SERVE_UPSCALE_DELAY_S = 30.0
RAY_SERVE_DOWNSCALE_DELAY_S = 600.0


class RayServePolicy(SimPolicy):
    name = "rayserve"
    keeps_node_copies = False

    def __init__(self, settings: PolicySettings, *, upscale_delay_s: float = RAY_SERVE_UPSCALE_DELAY_S,
                 downscale_delay_s: float = RAY_SERVE_DOWNSCALE_DELAY_S) -> None:
        super().__init__(settings)
        self.upscale_delay_s = upscale_delay_s
        self.downscale_delay_s = downscale_delay_s
        self.views: NodeViews | None = None
        self._target: list[int] = []  # Ray Serve's target replica count per model
        self._wish: list[tuple[int, float]] = []  # (direction, since)

    def attach(self, cluster, ticks) -> None:
        super().attach(cluster, ticks)
        self.views = NodeViews(cluster)
        self._target = [0] * len(cluster.models)
        self._wish = [(0, 0.0)] * len(cluster.models)

    def _desired(self, demand: int) -> int:
        return self.instances_for(demand)

    def on_demand(self, state) -> None:
        if self._desired(state.num_ongoing + len(state.queue)) != self._target[state.index] \
                or self._wish[state.index][0]:
            self.mark(state.index)

    def tick(self, now: float) -> None:
        cluster = self.cluster
        for index in self.take_dirty(now):
            state = cluster.models[index]
            self._autoscale(state, now)
            self._converge(state, now)
        # Replicas Ray could not place yet stay pending: they are retried every tick.
        self.waiting = {i for i in self.waiting if len(cluster.models[i].instances) < self._target[i]}
        if self.waiting:
            self.ticks.wake_next()

    def _autoscale(self, state, now: float) -> None:
        index = state.index
        current = self._target[index]
        desired = self._desired(state.num_ongoing + len(state.queue))
        if desired == current:
            self._wish[index] = (0, now)
            return
        if current == 0:  # the cold-start fast path: no delay from zero
            self._target[index] = desired
            self._wish[index] = (0, now)
            return
        direction = 1 if desired > current else -1
        wish, since = self._wish[index]
        if wish != direction:
            since = now
            self._wish[index] = (direction, now)
        delay = self.upscale_delay_s if direction > 0 else self.downscale_delay_s
        if now - since >= delay - 1e-9:
            self._target[index] = desired
            self._wish[index] = (0, now)
        else:
            self.wake_model_at(index, since + delay)

    def _converge(self, state, now: float) -> None:
        cluster = self.cluster
        live = list(state.instances)
        extra = len(live) - self._target[state.index]
        if extra > 0:
            live.sort(key=lambda i: (i.phase == InstanceState.READY, i.num_ongoing, -i.started_s))
            for instance in live[:extra]:
                cluster.stop_instance(instance)
            return
        for _ in range(-extra):
            views = self.views.views(state.index, now, locality=False)
            decision = place_locality_blind(state.model.weight_bytes, views, state.num_slots) if views else None
            if decision is None or not decision.placed:
                self.waiting.add(state.index)
                return
            cluster.start_instance(state.index, self.views.node_of(decision.node_id).index, "s3")
