"""A ServerlessLLM-like policy (Fu et al., OSDI '24), as the simulator's peer for Thaw's.

What it does, after the paper's design and its open-source defaults:

- Autoscaling: ceil(demand / target) instances, up at once; an instance idle for `keep_alive_s`
  is stopped (keep-alive is a hard lease: nothing else may take its slot meanwhile).
- Locality-aware loading: the node with room where the model is ready soonest, from its fastest
  tier (DRAM, then SSD, then the repository) plus the loader's queue -- the startup-time estimate
  of the paper's scheduler, which is what `controller.place` computes, so it is called here too.
- No eviction on demand and no preemption: a model whose requests find every slot taken waits
  until an instance's keep-alive runs out or one is freed by scaling down.
- No streaming from a running peer.
- Locality-driven live migration (token-based): when the node holding the model in its fastest
  tier is full, and freeing a slot there beats the best node with room, a running instance there
  is moved: its model is started on a node with room, its requests are re-sent there as tokens
  (the destination recomputes their KV) after `cost.migration_pause_s`, and the freed slot goes
  to the waiting model. Worth it when victim load + pause + local load < the best node's load.
"""

from __future__ import annotations

from controller import place
from sim.node_views import NodeViews, sim_tier
from sim.policies import PolicySettings, SimPolicy
from wire import InstanceState

__all__ = ["ServerlessLLMPolicy"]


class ServerlessLLMPolicy(SimPolicy):
    name = "serverlessllm"

    def __init__(self, settings: PolicySettings) -> None:
        super().__init__(settings)
        self.views: NodeViews | None = None
        self._desired: list[int] = []
        self._moves: dict[int, tuple[object, int, int]] = {}  # new instance -> (victim, waiting model, node)
        self._counts = {"locality_migrations": 0}

    def attach(self, cluster, ticks) -> None:
        super().attach(cluster, ticks)
        self.views = NodeViews(cluster)
        self._desired = [0] * len(cluster.models)

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def _wanted(self, demand: int) -> int:
        return self.instances_for(demand)

    def on_demand(self, state) -> None:
        demand = state.num_ongoing + len(state.queue)
        if demand == 0:
            if state.instances:
                # Idle-model fast path: every instance's keep-alive counts from the model's last
                # request (this moment), so the tick's look is due only when that runs out.
                self.wake_model_at(state.index, state.last_request_s + self.settings.keep_alive_s)
        elif self._wanted(demand) > len(state.instances):
            self.mark(state.index)

    def on_ready(self, instance) -> None:
        move = self._moves.pop(instance.index, None)
        if move is not None:
            victim, waiting_index, node_index = move
            if victim.phase == InstanceState.READY:
                self.cluster.migrate(victim, instance, token_based=True)
                self._counts["locality_migrations"] += 1
                waiting = self.cluster.models[waiting_index]
                node = self.cluster.nodes[node_index]
                if waiting.queue and node.free_slots >= waiting.num_slots:
                    tiers = self.cluster.checkpoint_tiers(node, waiting_index)
                    self.cluster.start_instance(waiting_index, node_index, tiers[0] if tiers else "s3")
        super().on_ready(instance)

    def tick(self, now: float) -> None:
        cluster = self.cluster
        for index in self.take_dirty(now):
            state = cluster.models[index]
            demand = state.num_ongoing + len(state.queue)
            wanted = self._wanted(demand)
            keep_alive = self.settings.keep_alive_s
            for instance in list(state.instances):
                if len(state.instances) <= wanted:
                    break
                if instance.num_ongoing == 0 and instance.phase == InstanceState.READY:
                    idle_since = max(instance.idle_since_s or now, state.last_request_s or 0.0)
                    if now - idle_since >= keep_alive:
                        cluster.stop_instance(instance)
                    else:
                        self.wake_model_at(index, idle_since + keep_alive)
            missing = wanted - len(state.instances) - sum(1 for v, w, _ in self._moves.values() if w == index)
            for _ in range(max(0, missing)):
                if not self._place(state, now):
                    break
        self.waiting = {i for i in self.waiting if cluster.models[i].queue}
        if any(not cluster.models[i].instances for i in self.waiting):
            self.ticks.wake_next()

    def _place(self, state, now: float) -> bool:
        cluster = self.cluster
        weight_bytes = state.model.weight_bytes
        views = self.views.views(state.index, now)
        decision = place(weight_bytes, views, state.num_slots) if views else None
        if decision is not None and decision.placed and decision.tier == "repository" and state.queue:
            if self._migrate_for(state, decision, now):
                return True
        if decision is None or not decision.placed:
            return False
        cluster.start_instance(state.index, self.views.node_of(decision.node_id).index, sim_tier(decision.tier))
        return True

    def _migrate_for(self, state, decision, now: float) -> bool:
        """Free a slot on a full node holding the model, by moving a running instance off it."""
        cluster = self.cluster
        for estimate in decision.estimates:
            if estimate.has_room or estimate.tier == "repository":
                continue
            node = self.views.node_of(estimate.node_id)
            victims = sorted((i for i in cluster.instances.values() if i.node_index == node.index
                              and i.phase == InstanceState.READY and i.num_slots >= state.num_slots
                              and i.model_index != state.index),
                             key=lambda i: (i.num_ongoing, i.index))
            for victim in victims:
                owner = cluster.models[victim.model_index]
                target_views = [v for v in self.views.views(owner.index, now) if v.node_id != node.node_id]
                target = place(owner.model.weight_bytes, target_views, owner.num_slots) if target_views else None
                if target is None or not target.placed:
                    continue
                pause_s = cluster.cost.migration_pause_s(owner.model, cluster.gpu, max(1, victim.num_ongoing), 0,
                                                     "tokens")
                if target.estimate_s + pause_s + estimate.load_s >= decision.estimate_s:
                    continue
                moved = cluster.start_instance(owner.index, self.views.node_of(target.node_id).index,
                                               sim_tier(target.tier))
                self._moves[moved.index] = (victim, state.index, node.index)
                return True
            return False
        return False
