"""Thaw's policy in the simulator: the controller's own policy functions, called unchanged.

Per tick, for each dirty model, in the controller's order (models waiting for a slot first,
`order_waiting`: by deadline slack, a model's soonest time to ready over the nodes placement looks
at as its load), the same steps as `Controller._autoscale_model` and
`InstancePlacer.place_and_start`, each a call into `controller`:

1. `plan_model(ModelView, now)`, the controller's own planner of a model's tick, over the
   model's desired count, its ongoing and queued requests, its last request time, its live
   instances and its sleepers: `decide`'s count, the extra instances to scale down in the stop
   order (put to sleep on slot hosts where they may: `sim.thaw_sleep`, the steps of the
   controller's `InstanceSleep`), the sleepers to wake first and how many to place;
2. carried out as `Controller._carry_out` does: the missing instances woken from sleep first,
   the rest placed with `place` over `NodeView`s (`sim.node_views`);
3. no free slot and requests queued: `choose_eviction` over the idle instances (`EvictionSettings`
   of the default `SlotSharingSettings`; frequency from a `UsageMeter` per model, as the
   controller's; with the waiting model's deadline and its oldest and newest waits, so a model whose
   requests are past saving does not evict before `lost_wait_s`), the victim's model's desired
   count lowered by one, then placement on the freed
   node (as `SlotSharer.steer` does with the held slot);
4. still none, and the model has no ready instance: `plan_slot_reclaim` (the controller's default
   `SlotReclaimCosts`) over ready instances whose model has a sibling, the victim's requests
   KV-migrated to that sibling, then placement on the freed node (as `SlotReclaimer.steer`);
5. still none and the oldest request waited `max_wait_before_preempt_s`: `choose_preemption` over
   busy instances (an equal priority only where the newest request can still meet its `ttft_slo_s`
   deadline, `SlotSharingSettings.deadline_preemption`), the victim's requests KV-migrated to another instance of its model
   (`choose_destination`) or suspended, then placement on the freed node;
6. the load path: `choose_load_path` (`PeerStreamSettings`, with the link rate set to the
   simulated network's) -- a peer's stream or the tier placement chose.

What is adapted, not the policies: the inputs are built from the simulated cluster; eviction
sees the `num_idle_candidates` longest-idle instances, preemption the `num_busy_candidates`
longest-running busy ones and slot reclaim the instances of `num_busy_candidates` models with a
sibling, rather than all 8,000 (the policies choose among those); slot reclaim is asked only when
no node has room (the controller also asks it when a full node would have the model ready sooner
than the nodes with room: a rarer case, and a costly scan at cluster scale); a freed slot
is used in the same tick where the cluster's stops are immediate (`ClusterSpec.stop_s` 0, the
cluster-scale model), and otherwise held for the model it was freed for until the victim is
gone, as `SlotSharer` holds it (other models' placement does not see it); prefill hand-off is not
simulated. Fast paths skip calls whose answer is known: `decide` for a model whose demand asks
for exactly the instances it has and no wish is pending (the cluster's `on_demand` marks a model
only when `desired_instances` changes), eviction when no instance is idle, slot reclaim for a model
that has a ready instance (the policy refuses it), preemption before the wait bound or when
nothing is busy.

Settings: the controller's defaults (`SlotSharingSettings()` with the keep-alive floor while slots are
contended on, `sim.policies.THAW_SHARING`; `AutoscalingPolicy`'s
`max_wait_before_preempt_s`) with the spec's keep-alive and delays of `sim.policies.ThawAutoscaling`
(keep-alive per restart, scale-up at once, extras kept 600 s: what a GPU deployment would set; each
model's restart estimate taken at its start, as the controller's `ModelState.restart_s`), or
those a run passes (`SimConfig.thaw_sharing`, `thaw_max_wait_before_preempt_s`, `thaw_spec`, or a
whole spec `AutoscalingPolicy` in `thaw_autoscaling` to replay a real deployment; `thaw simulate
--thaw-*`): the same code under another config, which is how a setting is studied. `describe()` reports the ones a run used.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from controller import (AutoscaleState, AutoscalingPolicy, EvictionCandidate,
                        ManagedInstance, ModelPlan, PeerStreamSettings, PlacementDecision, PreemptionCandidate,
                        SlotReclaimCosts, SlotSharingSettings, UsageMeter, WaitingModel, choose_destination,
                        choose_eviction, choose_load_path, choose_preemption, desired_instances, keep_alive_for,
                        order_waiting, place, plan_model, plan_slot_reclaim, SlotHold, views_past_holds)
from sim.node_views import NodeViews, sim_tier
from sim.sim_model_view import sim_model_view
from sim.policies import THAW_SHARING, PolicySettings, SimPolicy, ThawAutoscaling
from sim.thaw_sleep import eviction_candidate, scale_down, wake
from wire import InstanceState

__all__ = ["ThawPolicy"]

NUM_IDLE_CANDIDATES = 64
NUM_BUSY_CANDIDATES = 64


@dataclasses.dataclass
class _ModelControl:
    """What the controller keeps per model between ticks (`ModelState`'s volatile part)."""

    desired: int = 0
    restart_s: float | None = None  # `ModelState.restart_s`: from the node of its latest start
    autoscale: AutoscaleState = dataclasses.field(default_factory=AutoscaleState)
    usage: UsageMeter | None = None


class ThawPolicy(SimPolicy):
    name = "thaw"

    def __init__(self, settings: PolicySettings, *, sharing: SlotSharingSettings | None = None,
                 max_wait_before_preempt_s: float | None = None,
                 autoscaling: AutoscalingPolicy | None = None, activity_at_ticks: bool = False,
                 spec: ThawAutoscaling | None = None, slot_reclaim: bool = True, slot_sharing: bool = True,
                 sleep: bool = True) -> None:
        """`sharing` and `max_wait_before_preempt_s`: the controller config's `slot_sharing` and the
        model spec's bounded wait (None: the controller's defaults), so a setting is studied with
        the same code. `autoscaling`: every model's whole spec policy instead (a real deployment's,
        to replay it); `settings` then only says what the other policies get. `activity_at_ticks`:
        a model's last request is known at the next tick (`_seen_s`), as the controller learns it;
        False: at once (the cluster-scale figures were taken so). `spec`: the spec's keep-alive
        and delay settings (`ThawAutoscaling`; None: the controller's defaults). `slot_reclaim`:
        the controller config's `slot_reclaim` on (its default costs) or off. `slot_sharing` False:
        the controller config's ``slot_sharing=None`` (``thaw serve --no-slot-sharing``): keep-alive
        is a hard lease, a waiting model never evicts or preempts and waits by age for a slot to
        come free (`sharing` then must be None). `sleep`: the controller config's
        `sleep_idle_instances` (on slot hosts only: elsewhere nothing sleeps)."""
        super().__init__(settings)
        self.activity_at_ticks = activity_at_ticks
        if autoscaling is not None:
            if max_wait_before_preempt_s is not None:
                raise ValueError("ThawPolicy: give max_wait_before_preempt_s or autoscaling, not both")
            if spec is not None:
                raise ValueError("ThawPolicy: give spec or autoscaling, not both")
            self.autoscaling = autoscaling
        else:
            wait = {} if max_wait_before_preempt_s is None else {"max_wait_before_preempt_s": max_wait_before_preempt_s}
            self.autoscaling = AutoscalingPolicy(min_instances=0, max_instances=settings.max_instances,
                                                 target_ongoing_requests=settings.target_ongoing_requests,
                                                 keep_alive_s=settings.keep_alive_s,
                                                 **(spec.spec_fields() if spec is not None else {}), **wait)
        if not slot_sharing and sharing is not None:
            raise ValueError("ThawPolicy: give sharing settings or slot_sharing=False, not both")
        self.sharing: SlotSharingSettings | None = (sharing if sharing is not None else THAW_SHARING) \
            if slot_sharing else None
        self.reclaim_costs = SlotReclaimCosts() if slot_reclaim else None  # `ControllerConfig.slot_reclaim`
        self.sleep = sleep
        self.peer_stream: PeerStreamSettings | None = None
        self.views: NodeViews | None = None
        self._control: list[_ModelControl] = []
        self._idle: dict[int, object] = {}  # instance index -> instance, longest idle first
        self._desired_by_demand: list[int] = []
        # Models with queued requests and an instance loading for them: no look until it is ready
        # (kept apart from `waiting`, which the tick walks: at a day's start, hundreds load at once).
        self._loading_waiters: set[int] = set()
        # Slots being freed for a model (`SlotSharer`'s holds): model index -> node index. Only
        # when the cluster's stops take time (`ClusterSpec.stop_s`); otherwise the slot is free at once.
        self._holds: dict[int, int] = {}
        self._no_room_s: float | None = None  # `SlotSharer`'s: when a model with queued requests found no free slot
        self._counts = {"stream_starts": 0, "evictions_chosen": 0, "slot_reclaims": 0, "preemptions_migrated": 0,
                        "preemptions_suspended": 0, "sleeps_chosen": 0}

    def attach(self, cluster, ticks) -> None:
        super().attach(cluster, ticks)
        self.views = NodeViews(cluster)
        # The controller's defaults, with the stream rate of the simulated network instead of the
        # dev machine's loopback (PeerStreamSettings documents its default as that measurement).
        self.peer_stream = PeerStreamSettings(link_bytes_per_s=self.views.link_bytes_per_s)
        half_life = (self.sharing or THAW_SHARING).eviction.usage_half_life_s  # eviction's only
        self._control = [_ModelControl(usage=UsageMeter(half_life)) for _ in cluster.models]

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def describe(self) -> dict[str, object]:
        spec = {"ttft_slo_s": self.autoscaling.ttft_slo_s, "slot_reclaim": self.reclaim_costs is not None,
                "max_wait_before_preempt_s": self.autoscaling.max_wait_before_preempt_s,
                "keep_alive_s": self.autoscaling.keep_alive_s,
                "keep_alive_per_restart": self.autoscaling.keep_alive_per_restart,
                "min_keep_alive_s": self.autoscaling.min_keep_alive_s,
                "max_keep_alive_s": self.autoscaling.max_keep_alive_s,
                "upscale_delay_s": self.autoscaling.upscale_delay_s,
                "downscale_delay_s": self.autoscaling.downscale_delay_s,
                "models_per_gpu": self.cluster.spec.models_per_gpu if self.cluster is not None else 1,
                "sleep_idle_instances": self.sleep}
        if self.sharing is None:
            return {"slot_sharing": False, **spec}
        eviction = self.sharing.eviction
        return {"slot_sharing": True, "min_idle_s": eviction.min_idle_s, "usage_half_life_s": eviction.usage_half_life_s,
                "preempt": self.sharing.preempt, "deadline_preemption": self.sharing.deadline_preemption,
                "deadline_eviction": self.sharing.deadline_eviction, "lost_wait_s": eviction.lost_wait_s,
                "deadline_order": self.sharing.deadline_order, "starvation_bound_s": self.sharing.starvation_bound_s,
                "contended_keep_alive_s": self.sharing.contended_keep_alive_s,
                "min_run_s": self.sharing.min_run_s, **spec}

    # --- callbacks ---------------------------------------------------------------------------

    def on_demand(self, state) -> None:
        control = self._control[state.index]
        demand = state.num_ongoing + len(state.queue)
        if demand == 0:
            if control.desired == 1 and not control.autoscale.wish_direction and state.last_request_s is not None:
                # Idle-model fast path: with one instance wanted, decide holds it steady until the
                # keep-alive runs out; look again only then.
                self.wake_model_at(state.index, self._seen_s(state.last_request_s) + self._keep_alive_s(control))
            elif control.desired:
                self.mark(state.index)
        elif control.autoscale.wish_direction or self._desired(demand) != control.desired:
            self.mark(state.index)

    def _seen_s(self, time_s: float | None) -> float | None:
        """When the controller learns of a request's activity at `time_s`: at its next reconcile
        tick, which reads the workers' stats (`InstanceManager.apply_stats`: "requests that came and
        went between ticks count too"), so its `last_request_s` is a tick time. Ticks taken on the
        `tick_s` grid. Without `activity_at_ticks`, `time_s` itself."""
        if time_s is None or not self.activity_at_ticks:
            return time_s
        tick_s = self.ticks.tick_s
        return math.ceil(time_s / tick_s - 1e-9) * tick_s

    def _keep_alive_s(self, control: _ModelControl) -> float:
        """The model's keep-alive as `decide` computes it (`keep_alive_for`, with the floor while
        slots are contended)."""
        return keep_alive_for(self.autoscaling, control.restart_s, self._keep_alive_floor_s())

    def _keep_alive_floor_s(self) -> float:
        """`SlotSharer.keep_alive_floor_s`: `contended_keep_alive_s` while a model with queued
        requests found no free slot within that long (0 without slot sharing)."""
        if self.sharing is None:
            return 0.0
        return self.sharing.keep_alive_floor_s(self._no_room_s, self.cluster.loop.now)

    def _desired(self, demand: int) -> int:
        """`desired_instances(self.autoscaling, demand)`, remembered per demand (called per request)."""
        known = self._desired_by_demand
        while len(known) <= demand:
            known.append(desired_instances(self.autoscaling, len(known)))
        return known[demand]

    def on_started(self, state, now: float) -> None:
        self._control[state.index].usage.add(1, now)

    def on_idle(self, instance) -> None:
        self._idle.pop(instance.index, None)
        self._idle[instance.index] = instance  # an eviction candidate; `on_demand` saw the demand change

    def on_queued(self, state) -> None:
        if not state.num_loading:
            super().on_queued(state)
        elif state.index not in self._loading_waiters and state.index not in self.waiting:
            self._loading_waiters.add(state.index)  # its instance is loading: `on_ready` brings it back
            self.ticks.wake_now()  # the gateway's report wakes the controller all the same

    def on_ready(self, instance) -> None:
        super().on_ready(instance)
        self._settle(instance.model_index)

    def on_released(self, instance) -> None:
        self._idle.pop(instance.index, None)
        if instance.node_index in self._holds.values():
            self.ticks.wake_now()  # the held slot is free: its model is placed at once
        self._settle(instance.model_index)  # a stopped loading instance: its model waits again
        self.mark(instance.model_index)
        if self.waiting or self._loading_waiters:  # a slot is free: the waiting may go now
            self.ticks.wake_next()

    def _settle(self, model_index: int) -> None:
        """A waiting model whose loads are over (or gone) goes back to the waiting the tick retries."""
        if model_index in self._loading_waiters and not self.cluster.models[model_index].num_loading:
            self._loading_waiters.discard(model_index)
            if self.cluster.models[model_index].queue:
                self.waiting.add(model_index)

    # --- the tick ----------------------------------------------------------------------------

    def _stale(self, index: int, now: float) -> bool:
        """A timer of an idle model with one instance wanted is stale when its keep-alive has not
        run out yet: decide would hold the model steady. It is moved to when it does: a request
        came since it was set, or the keep-alive grew meanwhile (the floor while slots are
        contended), and without a timer then the instance would never be looked at again."""
        state = self.cluster.models[index]
        control = self._control[index]
        if state.queue or state.num_ongoing or control.desired != 1 or control.autoscale.wish_direction \
                or state.last_request_s is None:
            return False
        due_s = self._seen_s(state.last_request_s) + self._keep_alive_s(control)
        if due_s > now + 1e-9:
            self.wake_model_at(index, due_s)
            return True
        return False

    def tick(self, now: float) -> None:
        cluster = self.cluster
        # A waiting model whose instance is loading needs no look until it is ready (`on_ready`):
        # it waits in `_loading_waiters` meanwhile, so `waiting` holds only the others.
        states = cluster.models
        models = self.take_dirty(now, self._stale, self.waiting)
        sharing = self.sharing
        deadlines = sharing is not None and sharing.deadline_order
        waiting = [WaitingModel(model_id=states[i].model_id, oldest_wait_s=states[i].oldest_wait_s(now),
                                num_queued_requests=len(states[i].queue), newest_wait_s=states[i].newest_wait_s(now),
                                load_s=self._soonest_ready_s(states[i], now) if deadlines else None,
                                ttft_slo_s=self.autoscaling.ttft_slo_s if deadlines else None)
                   for i in models if states[i].queue and not states[i].num_loading]
        first = [cluster.model_index[w.model_id]
                 for w in order_waiting(waiting, sharing.priority_boost_s if sharing is not None else 0.0,
                                        sharing.starvation_bound_s if deadlines else None)]
        chosen = set(first)
        for index in first + [i for i in models if i not in chosen]:
            self._autoscale(cluster.models[index], now)
        waiting = set()
        for i in self.waiting:
            if states[i].queue:
                (self._loading_waiters if states[i].num_loading else waiting).add(i)
        self.waiting = waiting
        if waiting:
            self.ticks.wake_next()  # they try again next tick (eviction, then preemption past the bound)

    def _soonest_ready_s(self, state, now: float) -> float | None:
        """The model's soonest time to ready over the nodes placement looks at (those with room
        and those holding its checkpoint; `SlotSharer.waiting`'s `load_s`), None: no such node."""
        views = self.views.views(state.index, now)
        if not views:
            return None
        return min(e.ready_s for e in place(state.model.weight_bytes, views, state.num_slots).estimates)

    def _autoscale(self, state, now: float) -> None:
        control = self._control[state.index]
        queued = len(state.queue)
        demand = state.num_ongoing + queued
        if demand == 0 and control.desired == 0 and not state.instances:
            control.autoscale = AutoscaleState()
            return  # idle and scaled to zero: decide would say so
        plan = plan_model(sim_model_view(state, self.autoscaling, control.autoscale, control.desired,
                                         last_request_s=self._seen_s(state.last_request_s),
                                         restart_s=control.restart_s, keep_alive_floor_s=self._keep_alive_floor_s()),
                          now)
        control.desired, control.autoscale = plan.num_desired_instances, plan.autoscale_state
        self._carry_out(state, plan, now)
        auto = control.autoscale
        if auto.wish_direction and auto.wish_since_s is not None:
            delay = self.autoscaling.upscale_delay_s if auto.wish_direction > 0 else self.autoscaling.downscale_delay_s
            self.wake_model_at(state.index, auto.wish_since_s + delay)
        elif demand == 0 and control.desired:
            since = self._seen_s(state.last_request_s) if state.last_request_s is not None else auto.idle_since_s
            self.wake_model_at(state.index, max(now, (since or now) + self._keep_alive_s(control)))

    def _carry_out(self, state, plan: ModelPlan, now: float) -> None:
        """The plan, as the controller carries it out (`Controller._carry_out`), on the simulated
        cluster: no start back-off here (a simulated start does not fail)."""
        if plan.releases_holds:
            self._holds.pop(state.index, None)  # `SlotSharer.forget`
        if plan.scale_down:
            by_id = {i.instance_id: i for i in state.instances}
            for instance_id in plan.scale_down:
                if scale_down(self.cluster, by_id[instance_id], sleep=self.sleep) == "slept":
                    self._counts["sleeps_chosen"] += 1
        missing = plan.num_missing
        if missing and plan.wake_order:  # sleepers wake before anything is placed (`InstanceSleep.wake`)
            missing -= wake(self.cluster, state, missing, order=plan.wake_order)
        for _ in range(missing):
            if not self._place_and_start(state, now):
                break

    # --- placement, eviction, preemption -----------------------------------------------------

    def _place_and_start(self, state, now: float) -> bool:
        cluster = self.cluster
        weight_bytes = state.model.weight_bytes
        held = self._holds.get(state.index)
        if held is not None:  # a slot is being freed for it there: wait for it, then take it
            node = cluster.nodes[held]
            if cluster.room(node, state.index) < state.num_slots:
                return False
            del self._holds[state.index]
            views = [self.views.view(node, state.index, now)]
        else:
            views = self._reserved(self.views.views(state.index, now), state.index)
        decision = place(weight_bytes, views, state.num_slots) if views else None
        if (decision is None or not decision.placed) and state.queue and held is None:
            self._no_room_s = now
            if self.sharing is None:  # `SlotSharer.steer`/`preempt` leave the decision as it is
                decision = self._reclaim_for(state, now) or decision
            else:
                decision = self._evict_for(state, now) or self._reclaim_for(state, now) \
                    or self._preempt_for(state, now) or decision
        if decision is None or not decision.placed:
            return False
        node = self.views.node_of(decision.node_id)
        tier = decision.tier
        source = None
        ready = [i for i in state.instances if i.phase == InstanceState.READY]
        if ready:
            path = choose_load_path(state.model_id, node.node_id, weight_bytes, tier, decision.estimate_s,
                                    [self._managed(i, state, now) for i in state.instances], (),
                                    link_bytes_per_s=self.peer_stream.link_bytes_per_s,
                                    saturated_requests=self.peer_stream.saturated_requests)
            if path.kind == "stream":
                source = next(i for i in ready if i.instance_id == path.source_instance_id)
                self._counts["stream_starts"] += 1
        # The controller's `ModelState.restart_s`: the chosen node's read of its fastest tier.
        self._control[state.index].restart_s = self.views.bandwidths.restart_s(weight_bytes)
        cluster.start_instance(state.index, node.index, sim_tier(tier), stream_from=source)
        return True

    def _managed(self, instance, state, now: float, num_slots: int | None = None) -> ManagedInstance:
        """`instance` as the controller's record; `num_slots`: the slots it would free for the
        model a slot is sought for (`SimCluster.slots_freed_for`), else its own."""
        node_id = self.cluster.nodes[instance.node_index].node_id
        phase = InstanceState.READY if instance.phase == InstanceState.READY else InstanceState.LOADING
        return ManagedInstance(instance_id=instance.instance_id, model_id=state.model_id, node_id=node_id,
                               ray_node_id=node_id, actor_name=instance.instance_id,
                               num_worker_slots=instance.num_slots if num_slots is None else num_slots,
                               repository_name=state.model_id, phase=phase,
                               started_s=instance.started_s, ready_s=instance.ready_s,
                               num_ongoing_requests=instance.num_ongoing,
                               weights_resident=instance.resident_s <= now)

    def _reserved(self, views: list, model_index: int) -> list:
        """`views` as `model_index` must see them: slots held for other models taken out, by the
        controller's rule (`controller.slot_holds.views_past_holds`)."""
        if not self._holds:
            return views
        nodes, models = self.cluster.nodes, self.cluster.models
        return views_past_holds(views, [(other, SlotHold(nodes[node_index].node_id, models[other].num_slots))
                                        for other, node_index in self._holds.items()], model_index)

    def _freed_for(self, state, node, now: float) -> PlacementDecision:
        """After a stop for `state`'s model on `node`: placement there if the slot is free already,
        else an unplaced decision and a hold until it is (the controller's `_hold`)."""
        decision = place(state.model.weight_bytes, [self.views.view(node, state.index, now)], state.num_slots)
        if not decision.placed:
            self._holds[state.index] = node.index
        return decision

    def _place_among(self, state, instances, now: float) -> PlacementDecision:
        """Placement for `state`'s model over the nodes of `instances` (the candidates a slot may
        be freed from), slots held for other models taken out: what eviction, slot reclaim and
        preemption rank their victims' nodes by (placed: a slot there is free after all)."""
        nodes = {instance.node_index: self.cluster.nodes[instance.node_index] for instance in instances}
        return place(state.model.weight_bytes,
                     self._reserved(self.views.views(state.index, now, nodes.values()), state.index), state.num_slots)

    def _targets(self, decision: PlacementDecision) -> tuple[dict[str, float], dict[str, int]]:
        """As `SlotSharer._targets`: the waiting model's time to ready and free slots per node."""
        return ({e.node_id: e.ready_s for e in decision.estimates},
                {e.node_id: e.num_free_slots for e in decision.estimates})

    def _idle_candidates(self) -> list:
        found, stale = [], []
        for index, instance in self._idle.items():
            if instance.phase != InstanceState.READY or instance.num_ongoing:
                stale.append(index)
                continue
            found.append(instance)
            if len(found) >= NUM_IDLE_CANDIDATES:
                break
        for index in stale:
            del self._idle[index]
        return found

    def _reload(self, instance, state) -> tuple[str, float]:
        """Where the instance's checkpoint would come back from on its node (as `SlotSharer._reload`)."""
        node = self.cluster.nodes[instance.node_index]
        rates = self.views.bandwidths
        overhead = self.cluster.spec.start_overhead_s
        weight_bytes = state.model.weight_bytes
        if rates.dram_bytes_per_s and (state.index in node.dram or node.dram.fits(weight_bytes)):
            return "dram", overhead + weight_bytes / rates.dram_bytes_per_s
        if rates.ssd_bytes_per_s and state.index in node.ssd:
            return "ssd", overhead + weight_bytes / rates.ssd_bytes_per_s
        return "repository", overhead + weight_bytes / rates.repository_bytes_per_s

    def _evict_for(self, state, now: float) -> PlacementDecision | None:
        cluster = self.cluster
        # On slot hosts an idle instance makes room only where its GPUs would then fit the model.
        pool: dict[str, tuple[object, EvictionCandidate]] = {}  # instance id -> (instance, candidate)
        for instance in self._idle_candidates():
            freed = cluster.slots_freed_for(instance, state.index)
            if not freed:
                continue
            owner = cluster.models[instance.model_index]
            tier, reload_s = self._reload(instance, owner)
            since = max(t for t in (self._seen_s(owner.last_request_s), instance.ready_s) if t is not None)
            pool[instance.instance_id] = (instance, EvictionCandidate(
                instance_id=instance.instance_id, model_id=owner.model_id,
                node_id=cluster.nodes[instance.node_index].node_id, num_worker_slots=freed,
                ready=True, num_ongoing_requests=0, num_queued_requests=len(owner.queue),
                idle_s=max(0.0, now - since), num_model_instances=len(owner.instances),
                min_instances=self.autoscaling.min_instances, priority=self.autoscaling.priority,
                frequency=self._control[owner.index].usage.value(now), reload_s=reload_s, reload_tier=tier))
        sleepers = (s for node in cluster.nodes for s in node.sleepers.values()) if cluster.hosts is not None else ()
        for sleeper in itertools.islice(sleepers, NUM_IDLE_CANDIDATES):  # they hold places; on a GPU, no memory
            owner = cluster.models[sleeper.model_index]
            tier, reload_s = self._reload(sleeper, owner)
            candidate = eviction_candidate(cluster, sleeper, state.index, now, reload_s=reload_s, reload_tier=tier,
                                           frequency=self._control[owner.index].usage.value(now),
                                           priority=self.autoscaling.priority)
            if candidate is not None:
                pool[sleeper.instance_id] = (sleeper, candidate)
        if not pool:
            return None
        idle = [instance for instance, _ in pool.values()]
        candidates = [candidate for _, candidate in pool.values()]
        decision = self._place_among(state, idle, now)
        if decision.placed:
            return decision
        load_s, free = self._targets(decision)
        eviction = choose_eviction(state.model_id, candidates, load_s_by_node=load_s,
                                   settings=self.sharing.eviction, num_slots=state.num_slots,
                                   free_slots_by_node=free, oldest_wait_s=state.oldest_wait_s(now),
                                   newest_wait_s=state.newest_wait_s(now),
                                   ttft_slo_s=self.autoscaling.ttft_slo_s if self.sharing.deadline_eviction else None)
        if eviction.victim is None:
            return None
        victim = pool[eviction.victim.instance_id][0]
        node = cluster.nodes[victim.node_index]
        owner = self._control[victim.model_index]
        asleep = victim.phase == InstanceState.ASLEEP
        cluster.evict(victim)
        if not asleep:  # a sleeper is none of its model's wanted instances already
            owner.desired = max(self.autoscaling.min_instances, owner.desired - 1)  # `_shrink_after_eviction`
            owner.autoscale = AutoscaleState()
        self._counts["evictions_chosen"] += 1
        return self._freed_for(state, node, now)

    def _reclaim_for(self, state, now: float) -> PlacementDecision | None:
        """`SlotReclaimer.steer` when no node has room: `plan_slot_reclaim` over ready instances
        whose model has another ready instance to take their requests (up to
        `NUM_BUSY_CANDIDATES` such models, and their siblings); the victim's requests KV-migrated,
        it stops, and the freed slot is placed on (or held) as after an eviction."""
        if self.reclaim_costs is None or any(i.phase == InstanceState.READY for i in state.instances):
            return None  # a model already served scales out where there is room (the policy's guard)
        cluster = self.cluster
        owners: dict[int, list] = {}
        for instance in cluster.instances.values():
            if instance.phase == InstanceState.READY and instance.model_index != state.index \
                    and instance.node_index >= 0:
                owners.setdefault(instance.model_index, []).append(instance)
        siblings = [group for group in owners.values() if len(group) >= 2][:NUM_BUSY_CANDIDATES]
        if not siblings:
            return None
        by_id = {instance.instance_id: instance for group in siblings for instance in group}
        managed = [self._managed(instance, cluster.models[instance.model_index], now,
                                 cluster.slots_freed_for(instance, state.index)) for instance in by_id.values()]
        decision = self._place_among(state, by_id.values(), now)
        if decision.placed:
            return decision
        plan, _ = plan_slot_reclaim(state.model_id, decision, managed, (), self.reclaim_costs, state.num_slots)
        if plan is None:
            return None
        victim, destination = by_id[plan.victim_instance_id], by_id[plan.destination_instance_id]
        node = cluster.nodes[victim.node_index]
        cluster.migrate(victim, destination, token_based=False)
        self._counts["slot_reclaims"] += 1
        return self._freed_for(state, node, now)

    def _preempt_for(self, state, now: float) -> PlacementDecision | None:
        if not self.sharing.preempt:
            return None
        if state.oldest_wait_s(now) < self.autoscaling.max_wait_before_preempt_s:
            return None  # before the bound `choose_preemption` refuses
        newest_wait_s = state.newest_wait_s(now)
        slo_s = self.autoscaling.ttft_slo_s if self.sharing.deadline_preemption else None
        cluster = self.cluster
        busy = []
        for instance in cluster.instances.values():
            if instance.phase == InstanceState.READY and instance.num_ongoing and instance.model_index != state.index \
                    and instance.node_index >= 0 and cluster.slots_freed_for(instance, state.index):
                busy.append(instance)
                if len(busy) >= NUM_BUSY_CANDIDATES:
                    break
        if not busy:
            return None
        candidates, destinations = [], {}
        for instance in busy:
            owner = cluster.models[instance.model_index]
            managed = [self._managed(i, owner, now) for i in owner.instances]
            source = next(m for m in managed if m.instance_id == instance.instance_id)
            destination, _ = choose_destination(source, managed, ())
            if destination is not None:
                destinations[instance.instance_id] = next(i for i in owner.instances
                                                          if i.instance_id == destination.instance_id)
            candidates.append(PreemptionCandidate(
                instance_id=instance.instance_id, model_id=owner.model_id,
                node_id=cluster.nodes[instance.node_index].node_id,
                num_worker_slots=cluster.slots_freed_for(instance, state.index),
                ready=True, num_ongoing_requests=instance.num_ongoing, ready_for_s=now - instance.ready_s,
                priority=self.autoscaling.priority,
                destination_instance_id=destination.instance_id if destination is not None else None))
        decision = self._place_among(state, busy, now)
        if decision.placed:
            return decision
        load_s, free = self._targets(decision)
        choice = choose_preemption(state.model_id, priority=self.autoscaling.priority,
                                   oldest_wait_s=state.oldest_wait_s(now),
                                   max_wait_before_preempt_s=self.autoscaling.max_wait_before_preempt_s,
                                   candidates=candidates, load_s_by_node=load_s, min_run_s=self.sharing.min_run_s,
                                   num_slots=state.num_slots, free_slots_by_node=free, newest_wait_s=newest_wait_s,
                                   ttft_slo_s=slo_s)
        if choice.victim is None:
            return None
        victim = busy[[c.instance_id for c in candidates].index(choice.victim.instance_id)]
        node = cluster.nodes[victim.node_index]
        if choice.action == "migrate":
            cluster.migrate(victim, destinations[victim.instance_id], token_based=False)
            self._counts["preemptions_migrated"] += 1
        else:
            cluster.suspend(victim)
            self._counts["preemptions_suspended"] += 1
        return self._freed_for(state, node, now)
