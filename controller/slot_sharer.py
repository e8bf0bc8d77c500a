"""Slots shared on demand: `SlotSharer` hands slots to the models whose requests wait for them.

A node has a few slots and the platform hosts many more models, so a slot is a cache entry, not a
possession. When a model has queued requests and placement finds no free slot, the controller,
in this order (ARCHITECTURE.md, "Slots are shared on demand"):

1. takes a free slot (placement; a slot freed for a model is held for it, see below);
2. evicts the idle instance cheapest to bring back and least likely to be wanted
   (`eviction_policy.choose_eviction`: keep-alive is a soft lease; `min_instances` is not; with
   `deadline_eviction`, not for a model whose requests are past saving there until its oldest
   has waited `lost_wait_s`);
   its model's desired count drops by one, and its checkpoint is kept in (or, once the node
   settles, copied into) the node's DRAM tier so its next cold start is a DRAM one;
3. moves a busy instance's requests to another instance of its model (`SlotReclaimer`, which
   the controller asks between 2 and 4);
4. once the model's oldest request has waited its `max_wait_before_preempt_s`, preempts a busy
   instance of a model of no higher priority (`preemption_policy.choose_preemption`): its
   requests are migrated to another instance of its model when there is one, else *suspended*:
   the worker ends each stream with finish reason "suspended", the gateway puts the request back
   in its model's queue with the tokens its client already has, and the model's next instance
   continues it from there (greedy output equals an uninterrupted run). The suspended model now
   waits in turn and gets a slot back by the same rules.

Waiting models are served in `slot_queue_policy.order_waiting` order (by deadline slack, with
each model's soonest time to ready on a node of its kind as its load, else oldest request first,
weighted by priority); `order` puts them first in the controller's autoscale pass. A slot freed
by 2 or 4 is *held* for the model it was freed for until it is free (the victim drains, then
stops), so no other model's placement takes it meanwhile; a hold not free by its deadline is
given up and the model placed as usual.

Every decision is recorded with its reason (``thaw status`` recent decisions, the log) and
counted (`counts`); `outlook` answers a gateway's queue report with where the model stands.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from controller.control_context import ControlContext
from controller.cluster_client import ClusterClient
from controller.cluster_node import ClusterNode, dram_can_take, node_view, nodes_of_kind, tier_bandwidths
from controller.controller_config import ControllerConfig
from controller.eviction_policy import EvictionCandidate, choose_eviction, eviction_score
from controller.instance_manager import InstanceManager
from controller.managed_instance import ManagedInstance
from controller.migration_policy import choose_destination
from controller.model_state import ModelState
from controller.slot_holds import SlotHold
from controller.placement_policy import NodeView, PlacementDecision, estimate_node, place
from controller.preemption_policy import PreemptionCandidate, choose_preemption
from controller.request_mover import RequestMover
from controller.slot_outlook import SlotHolder, SlotOutlook
from controller.slot_queue_policy import WaitingModel, order_waiting
from wire import InstanceState

logger = logging.getLogger(__name__)

__all__ = ["SlotSharer"]

MAX_START_SAMPLES = 20
COUNTERS = ("evictions", "preemptions_migrated", "preemptions_suspended", "requests_suspended",
            "requests_parked_with_kv", "requests_resumed_with_kv", "holds_abandoned")


@dataclasses.dataclass(frozen=True)
class _Hold:
    """A slot on `node_id` being freed for a model (by evicting or preempting `victim_instance_id`)."""

    node_id: str
    num_slots: int
    kind: str  # "eviction" or "preemption"
    victim_instance_id: str
    victim_model_id: str
    started_s: float
    deadline_s: float
    load_s: float  # the waiting model's estimated load there, once the slot is free
    memory_bytes: int = 0  # of the node's worker memory budget, held for the waiting model
    more_victim_ids: tuple[str, ...] = ()  # further instances stopped with the victim until it fit


class SlotSharer:
    """See the module docstring. Runs on the controller's event loop and reads its live
    instances, nodes and models; `shrink(model_id, reason)` lowers an evicted model's desired
    count (the controller's, since the count is durable state it owns)."""

    def __init__(self, config: ControllerConfig, cluster: ClusterClient, instances: InstanceManager,
                 nodes: Mapping[str, ClusterNode], models: Mapping[str, ModelState], mover: RequestMover, *,
                 draining_nodes: Callable[[], set[str]], shrink: Callable[[str, str], None],
                 keep_in_dram: Callable[[ManagedInstance], None], context: ControlContext) -> None:
        self.config = config
        self._cluster = cluster
        self._instances = instances
        self._nodes = nodes
        self._models = models
        self._mover = mover
        self._draining_nodes = draining_nodes
        self._shrink = shrink
        self._keep_in_dram = keep_in_dram
        self._record = context.record
        self._wall_clock = context.wall_clock
        self._background = context.background
        self._holds: dict[str, _Hold] = {}  # model id -> the slot being freed for it
        self._suspended: dict[str, dict[str, tuple[float, str]]] = {}  # model -> {request: (at (wall), "kv"/"tokens")}
        self._parked: dict[str, dict[str, Any]] = {}  # model id -> {request id: migration.ParkedRequest}
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._no_room_s: float | None = None  # when a model with queued requests last found no free slot
        # Recent starts' load time beyond their read estimate: a start's fixed cost in reload_s.
        self._start_overheads: collections.deque[float] = collections.deque(maxlen=MAX_START_SAMPLES)
        self._sampled_starts: collections.OrderedDict[str, None] = collections.OrderedDict()

    # --- queries -----------------------------------------------------------------------------

    def _queued(self, model: ModelState, now: float) -> int:
        return model.num_queued_requests(now, self.config.queue_report_ttl_s)

    def waiting(self, now: float) -> list[WaitingModel]:
        """Models with queued requests and no instance starting for them, in the order they get slots
        (with `SlotSharingSettings.deadline_order`, each with its deadline, newest wait and soonest
        time to ready for `order_waiting`'s slack)."""
        settings = self.config.slot_sharing
        deadlines = settings is not None and settings.deadline_order
        ttl_s = self.config.queue_report_ttl_s
        waiting = []
        for model in self._models.values():
            queued = self._queued(model, now)
            if queued and not any(i.phase is InstanceState.LOADING for i in self._instances.live(model.model_id)):
                policy = model.spec.autoscaling
                waiting.append(WaitingModel(model_id=model.model_id, priority=policy.priority,
                                            oldest_wait_s=model.oldest_wait_s(now, ttl_s), num_queued_requests=queued,
                                            newest_wait_s=model.newest_wait_s(now, ttl_s) if deadlines else None,
                                            load_s=self._soonest_ready_s(model, now) if deadlines else None,
                                            ttft_slo_s=policy.ttft_slo_s if deadlines else None))
        boost = settings.priority_boost_s if settings else 0.0
        return order_waiting(waiting, boost, settings.starvation_bound_s if deadlines else None)

    def _soonest_ready_s(self, model: ModelState, now: float) -> float | None:
        """The model's soonest time to ready on any connected node of its kind, room or not
        (placement's estimate), None: its size or every such node is unknown."""
        if model.num_bytes is None:
            return None
        connected = [n for n in self._nodes.values() if n.store is not None and not n.draining]
        nodes, _ = nodes_of_kind(model.spec.resources.num_gpus, connected)
        instances = self._instances.all()
        return min((estimate_node(model.num_bytes, node_view(node, model.repository_name, instances, self.config,
                                                              now)).ready_s for node in nodes), default=None)

    def keep_alive_floor_s(self, now: float) -> float:
        """The least keep-alive while slots are contended: `contended_keep_alive_s` when a model
        with queued requests found no free slot within that long, else 0 (`LoadSnapshot`). A model
        short of a node's worker memory budget does not count: an idle model there sleeps when its
        keep-alive runs out, which frees the memory and keeps its weights, and a sleeper is the
        eviction policy's first victim anyway."""
        settings = self.config.slot_sharing
        return 0.0 if settings is None else settings.keep_alive_floor_s(self._no_room_s, now)

    def order(self, models: Sequence[ModelState], now: float) -> list[ModelState]:
        """`models` as the autoscale pass should take them: the waiting ones first, in turn."""
        by_id = {m.model_id: m for m in models}
        first = [by_id[w.model_id] for w in self.waiting(now) if w.model_id in by_id]
        return first + sorted((m for m in models if m not in first), key=lambda m: m.model_id)

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def holds(self) -> list[tuple[str, SlotHold]]:
        """(model id, the slot held for it) for each slot being freed by an eviction or a preemption
        (`controller.slot_holds`)."""
        return [(model_id, SlotHold(h.node_id, h.num_slots, h.memory_bytes)) for model_id, h in self._holds.items()]

    def status(self, now: float) -> dict[str, Any]:
        """For ``thaw status``: held slots, suspended requests, counters, and every slot's holder."""
        wall = self._wall_clock()
        return {
            "holds": [{"model_id": model_id, "node_id": h.node_id, "kind": h.kind, "victim_instance_id":
                       h.victim_instance_id, "victim_model_id": h.victim_model_id, "held_s": now - h.started_s,
                       "more_victim_instance_ids": list(h.more_victim_ids), "memory_bytes": h.memory_bytes}
                      for model_id, h in sorted(self._holds.items())],
            "suspended": [{"model_id": model_id, "request_id": rid, "suspended_s": wall - at, "kept": how}
                          for model_id, rids in sorted(self._suspended.items())
                          for rid, (at, how) in sorted(rids.items())],
            "parked_kv_bytes": self._parked_bytes(),
            "counts": self.counts(),
            "slots": [dataclasses.asdict(h) | {"eviction_score": score}
                      for h, score in self._holders_with_scores(now)],
        }

    # --- the controller's placement asks -----------------------------------------------------

    def forget(self, model_id: str, why: str) -> None:
        """The model no longer needs its held slot (deleted, scaled down)."""
        hold = self._holds.pop(model_id, None)
        if hold is not None:
            self._give_up(model_id, hold, why)

    def model_deleted(self, model_id: str) -> None:
        """The model is gone: its held slot, its parked KV and its suspended requests with it."""
        self.forget(model_id, "model deleted")
        self._parked.pop(model_id, None)
        self._suspended.pop(model_id, None)

    def model_ready(self, model_id: str) -> None:
        """An instance of the model became ready: its suspended requests resume there (their
        clients come back to it; those whose KV was not replayed recompute it from their tokens)."""
        resumed = self._suspended.pop(model_id, None)
        if resumed:
            self._record({"kind": "resume", "model_id": model_id, "request_ids": sorted(resumed),
                          "kept": {rid: how for rid, (_, how) in sorted(resumed.items())},
                          "reason": f"{len(resumed)} suspended request(s) continue on the model's new instance",
                          "at_s": self._wall_clock()})
            logger.info("%s: %d suspended request(s) resume", model_id, len(resumed))

    async def before_ready(self, instance: ManagedInstance) -> None:
        """Awaited before a new instance is routed: the model's requests parked with their KV are
        replayed into it, so each continues from where it stopped when its client comes back
        (a replay that fails leaves that request to its tokens)."""
        parked = self._parked.pop(instance.model_id, None)
        if not parked or instance.handle is None:
            return
        timeout_s = self.config.slot_sharing.suspend_timeout_s if self.config.slot_sharing else 10.0
        try:
            replayed = await self._cluster.unpark_requests(instance.handle, instance.instance_id,
                                                           list(parked.values()), timeout_s)
        except Exception as exc:  # noqa: BLE001 - the clients recompute from their tokens instead
            logger.warning("%s: replaying %d parked request(s) into %s failed: %s: %s", instance.model_id,
                           len(parked), instance.instance_id, type(exc).__name__, exc)
            replayed = []
        self._counts["requests_resumed_with_kv"] += len(replayed)
        lost = sorted(set(parked) - set(replayed))
        for request_id in lost:  # their clients recompute the KV from their tokens
            at, _ = self._suspended.get(instance.model_id, {}).get(request_id, (self._wall_clock(), "kv"))
            self._suspended.setdefault(instance.model_id, {})[request_id] = (at, "tokens")
        logger.info("%s: %d parked request(s) replayed into %s with their KV%s", instance.model_id, len(replayed),
                    instance.instance_id, f"; {len(lost)} left to their tokens" if lost else "")

    def steer(self, model: ModelState, decision: PlacementDecision, views: Sequence[NodeView], num_slots: int,
              now: float, memory_bytes: int = 0) -> PlacementDecision | None:
        """Placement's decision for one more instance of `model`, or one restricted to the node a
        slot is held on for it, or None: wait, a slot is being freed (idle instances evicted until
        the instance's `memory_bytes` fit the node's worker memory budget, where it has one; or an
        instance stopping anyway frees room for it, `_being_freed`)."""
        model_id = model.model_id
        hold = self._holds.get(model_id)
        if hold is not None:
            view = next((v for v in views if v.node_id == hold.node_id), None)
            freed = None if view is None else place(model.num_bytes, [view], num_slots, memory_bytes)
            if freed is not None and freed.placed:
                del self._holds[model_id]
                return freed
            if view is not None and now < hold.deadline_s:
                return None
            del self._holds[model_id]
            self._give_up(model_id, hold, "the node is gone" if view is None else
                          f"the slot was not free {now - hold.started_s:.3g}s after {hold.victim_instance_id} "
                          f"was stopped")
            return decision
        if decision.placed or self.config.slot_sharing is None or not self._queued(model, now):
            return decision
        if not any(e.num_free_slots >= num_slots for e in decision.estimates):
            self._no_room_s = now  # short of slots, not of a memory budget: there an idle model sleeps
        load_s, free, free_memory = self._targets(decision)
        if self._being_freed(load_s, free, free_memory, num_slots, memory_bytes) is not None:
            return None
        settings = self.config.slot_sharing
        ttl_s = self.config.queue_report_ttl_s
        eviction = choose_eviction(model_id, self._eviction_candidates(now), load_s_by_node=load_s,
                                   settings=settings.eviction, num_slots=num_slots,
                                   free_slots_by_node=free, memory_bytes=memory_bytes,
                                   free_memory_by_node=free_memory, oldest_wait_s=model.oldest_wait_s(now, ttl_s),
                                   newest_wait_s=model.newest_wait_s(now, ttl_s),
                                   ttft_slo_s=model.spec.autoscaling.ttft_slo_s if settings.deadline_eviction else None)
        victims = [self._instances.get(c.instance_id) for c in eviction.victims]
        if not victims or any(v is None or v.phase not in (InstanceState.READY, InstanceState.ASLEEP)
                              for v in victims):
            return dataclasses.replace(decision, reason=f"{decision.reason}; {eviction.reason}")
        for victim in victims:
            asleep = victim.phase is InstanceState.ASLEEP
            self._instances.begin_stop(victim, f"evicted for {model_id} ({'asleep' if asleep else 'idle'})",
                                       self.config.drain_timeout_s, recycle=True)
            if not asleep:  # a sleeper is no longer one of its model's instances: nothing to shrink
                self._shrink(victim.model_id, f"its idle instance {victim.instance_id} gave its slot to {model_id}")
            self._keep_in_dram(victim)
        victim = victims[0]
        self._hold(model_id, "eviction", victim, num_slots, load_s[victim.node_id], now, memory_bytes,
                   tuple(v.instance_id for v in victims[1:]))
        self._counts["evictions"] += len(victims)
        self._record({"kind": "eviction", "model_id": model_id, "instance_id": victim.instance_id,
                      "victim_model_id": victim.model_id, "node_id": victim.node_id, "score": eviction.score,
                      "more_victims": [[v.instance_id, v.model_id] for v in victims[1:]],
                      "ranked": [list(r) for r in eviction.ranked], "reason": eviction.reason,
                      "at_s": self._wall_clock()})
        logger.info("%s: %s", model_id, eviction.reason)
        return None

    def preempt(self, model: ModelState, decision: PlacementDecision, num_slots: int,
                now: float, memory_bytes: int = 0) -> PlacementDecision | None:
        """Asked when nothing else gave `model` a slot: preempt a busy instance for it once its
        oldest request waited its bound (None: wait, the slot is being freed), else `decision`.
        One victim per tick: where it frees too little of a worker memory budget, the hold is given
        up at its deadline and the next tick preempts again."""
        settings = self.config.slot_sharing
        if decision.placed or settings is None or not settings.preempt or not self._queued(model, now):
            return decision
        policy = model.spec.autoscaling
        load_s, free, _ = self._targets(decision)
        ttl_s = self.config.queue_report_ttl_s
        choice = choose_preemption(
            model.model_id, priority=policy.priority, oldest_wait_s=model.oldest_wait_s(now, ttl_s),
            max_wait_before_preempt_s=policy.max_wait_before_preempt_s, candidates=self._preemption_candidates(now),
            load_s_by_node=load_s, min_run_s=settings.min_run_s, num_slots=num_slots, free_slots_by_node=free,
            newest_wait_s=model.newest_wait_s(now, ttl_s),
            ttft_slo_s=policy.ttft_slo_s if settings.deadline_preemption else None)
        victim = choice.victim and self._instances.get(choice.victim.instance_id)
        if victim is None or victim.phase is not InstanceState.READY:
            return dataclasses.replace(decision, reason=f"{decision.reason}; {choice.reason}")
        self._instances.begin_stop(victim, f"preempted for {model.model_id} ({choice.action})",
                                   self.config.drain_timeout_s, recycle=True)
        if victim.handle is not None:
            work = self._mover.move_off(victim) if choice.action == "migrate" else self._suspend(victim)
            task = asyncio.get_running_loop().create_task(work)
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        self._keep_in_dram(victim)  # a preempted model comes back as an evicted one does
        self._hold(model.model_id, "preemption", victim, num_slots, load_s[victim.node_id], now, memory_bytes)
        self._counts["preemptions_migrated" if choice.action == "migrate" else "preemptions_suspended"] += 1
        self._record({"kind": "preemption", "action": choice.action, "model_id": model.model_id,
                      "instance_id": victim.instance_id, "victim_model_id": victim.model_id,
                      "node_id": victim.node_id, "reason": choice.reason, "at_s": self._wall_clock()})
        logger.info("%s: %s", model.model_id, choice.reason)
        return None

    # --- the gateway's question --------------------------------------------------------------

    def outlook(self, model_id: str, now: float) -> SlotOutlook:
        """Where `model_id` stands for its waiting requests (see `controller.slot_outlook`)."""
        live = self._instances.live(model_id)
        holders = tuple(h for h, _ in self._holders_with_scores(now))
        if any(i.phase is InstanceState.READY for i in live):
            return SlotOutlook(model_id=model_id, status="ready", estimate_s=0.0,
                               reason="an instance is ready; requests wait for room on it", holders=holders)
        loading = [i for i in live if i.phase is InstanceState.LOADING]
        overhead_s = self.start_overhead_s()
        if loading:
            # Placement's read estimate plus a start's measured fixed cost (the same calibrated
            # model the eviction score prices reloads with); unknown once the instance is late.
            known = [r for r in (i.expected_remaining_s(now, overhead_s) for i in loading) if r is not None]
            late = "" if known else ", taking longer than estimated"
            return SlotOutlook(model_id=model_id, status="loading", estimate_s=min(known) if known else None,
                               reason=f"instance {loading[0].instance_id} is loading on {loading[0].node_id}{late}",
                               holders=holders)
        model = self._models.get(model_id)
        hold = self._holds.get(model_id)
        if hold is not None:
            victim = self._instances.get(hold.victim_instance_id)
            freeing = self.config.slot_reclaim.stop_s if self.config.slot_reclaim else 0.5
            if victim is not None and victim.num_ongoing_requests:
                freeing += self.config.slot_reclaim.migrate_s_per_request if self.config.slot_reclaim else 0.3
            return SlotOutlook(model_id=model_id, status="waiting_for_slot", position=1,
                               estimate_s=freeing + hold.load_s + overhead_s,
                               reason=f"a slot on {hold.node_id} is being freed for it ({hold.kind} of "
                                      f"{hold.victim_instance_id}, {hold.victim_model_id})", holders=holders)
        order = [w.model_id for w in self.waiting(now)]
        if model is None or model_id not in order:
            why = model.last_placement["reason"] if model is not None and model.last_placement else "starting"
            return SlotOutlook(model_id=model_id, status="unplaced", reason=why, holders=holders)
        position = order.index(model_id) + 1
        return SlotOutlook(model_id=model_id, status="waiting_for_slot", position=position,
                           estimate_s=self._wait_estimate(model, position, now, overhead_s),
                           reason=f"every slot is busy; position {position} of {len(order)} models waiting",
                           holders=holders)

    def _wait_estimate(self, model: ModelState, position: int, now: float, overhead_s: float) -> float | None:
        """About how long until `model` is ready: its own load (placement's read estimate plus a
        start's measured fixed cost), after the slots freed for the models ahead of it, each at the
        soonest a busy slot can be preempted (it has served `min_run_s`, and as long as a load
        takes: `choose_preemption`)."""
        placement = model.last_placement or {}
        read_s = min((e["ready_s"] for e in placement.get("estimates", ())), default=None)
        load_s = None if read_s is None else read_s + overhead_s
        settings = self.config.slot_sharing
        if load_s is None or settings is None:
            return None
        policy = model.spec.autoscaling
        oldest = model.oldest_wait_s(now, self.config.queue_report_ttl_s)
        until_preempt = max(0.0, policy.max_wait_before_preempt_s - oldest) if settings.preempt else 0.0
        return until_preempt + load_s + (position - 1) * (max(settings.min_run_s, load_s) + load_s)

    # --- internals ---------------------------------------------------------------------------

    def _being_freed(self, load_s: dict[str, float], free: dict[str, int], free_memory: dict[str, int],
                     num_slots: int, memory_bytes: int) -> ManagedInstance | None:
        """An instance already stopping with no request left (a scale-down, a model deleted), on a
        node the waiting model may go to, whose slots and memory make room for it there once it is
        gone, and not being freed for another model: the waiting model takes that room in a moment,
        so evicting another model's warm instance (or migrating, or preempting) would cost a reload
        for nothing. A stop with requests still draining may take `drain_timeout_s`: not waited for."""
        held = {i for h in self._holds.values() for i in (h.victim_instance_id, *h.more_victim_ids)}
        for instance in self._instances.all():
            node_id = instance.node_id
            if instance.phase is not InstanceState.STOPPING or instance.num_ongoing_requests \
                    or not instance.holds_slot or node_id not in load_s or instance.instance_id in held:
                continue
            if free.get(node_id, 0) + instance.num_worker_slots < num_slots:
                continue
            budget = free_memory.get(node_id)
            if budget is None or budget + instance.held_memory_bytes >= memory_bytes:
                return instance
        return None

    def _hold(self, model_id: str, kind: str, victim: ManagedInstance, num_slots: int, load_s: float,
              now: float, memory_bytes: int = 0, more_victim_ids: tuple[str, ...] = ()) -> None:
        deadline = now + self.config.drain_timeout_s + (self.config.slot_sharing.suspend_timeout_s
                                                        if self.config.slot_sharing else 0.0)
        self._holds[model_id] = _Hold(victim.node_id, num_slots, kind, victim.instance_id, victim.model_id, now,
                                      deadline, load_s, memory_bytes, more_victim_ids)

    def _give_up(self, model_id: str, hold: _Hold, why: str) -> None:
        self._counts["holds_abandoned"] += 1
        self._record({"kind": "slot_hold_abandoned", "model_id": model_id, "node_id": hold.node_id,
                      "reason": why, "at_s": self._wall_clock()})
        logger.warning("%s: giving up the slot held on %s: %s", model_id, hold.node_id, why)

    def _targets(self, decision: PlacementDecision) -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
        """The waiting model's time to ready on each node it may go to, the free slots there, and
        the free worker memory of those with a budget."""
        draining = self._draining_nodes()
        load_s = {e.node_id: e.ready_s for e in decision.estimates if e.node_id not in draining}
        free = {e.node_id: e.num_free_slots for e in decision.estimates}
        free_memory = {e.node_id: e.free_memory_bytes for e in decision.estimates if e.free_memory_bytes is not None}
        return load_s, free, free_memory

    def _parked_bytes(self) -> int:
        return sum(p.num_bytes for parked in self._parked.values() for p in parked.values())

    async def _suspend(self, victim: ManagedInstance) -> None:
        """Parks the victim's requests with their KV while the budget lasts (a KV migration into
        this process's memory), then ends every other stream "suspended" (its KV to be
        recomputed from its tokens). Either way the gateway queues them for the model's next slot."""
        settings = self.config.slot_sharing
        timeout_s = settings.suspend_timeout_s if settings else 10.0
        budget = (settings.max_parked_kv_bytes if settings else 0) - self._parked_bytes()
        parked: dict[str, Any] = {}
        if budget > 0:
            try:
                parked = await self._cluster.park_requests(victim.handle, victim.instance_id, budget, timeout_s)
            except Exception as exc:  # noqa: BLE001 - they are suspended by their tokens instead
                logger.warning("%s: parking the KV of %s's requests failed: %s: %s", victim.model_id,
                               victim.instance_id, type(exc).__name__, exc)
        if parked:
            self._parked.setdefault(victim.model_id, {}).update(parked)
        try:
            by_tokens = await self._cluster.suspend_requests(victim.handle, timeout_s)
        except Exception as exc:  # noqa: BLE001 - its drain then lets the requests finish where they are
            logger.warning("%s: suspending the requests of %s failed: %s: %s", victim.model_id, victim.instance_id,
                           type(exc).__name__, exc)
            by_tokens = []
        by_tokens = [rid for rid in by_tokens if rid not in parked]
        if parked or by_tokens:
            wall = self._wall_clock()
            kept = {**dict.fromkeys(parked, (wall, "kv")), **dict.fromkeys(by_tokens, (wall, "tokens"))}
            self._suspended.setdefault(victim.model_id, {}).update(kept)
            self._counts["requests_suspended"] += len(kept)
            self._counts["requests_parked_with_kv"] += len(parked)
            num_bytes = sum(p.num_bytes for p in parked.values())
            self._record({"kind": "suspend", "model_id": victim.model_id, "instance_id": victim.instance_id,
                          "request_ids": sorted(kept), "kv_request_ids": sorted(parked),
                          "token_request_ids": sorted(by_tokens),
                          "reason": f"{len(kept)} request(s) wait for {victim.model_id}'s next slot: {len(parked)} "
                                    f"with their KV parked ({num_bytes} bytes), {len(by_tokens)} by their tokens",
                          "at_s": wall})

    def _idle_s(self, instance: ManagedInstance, model: ModelState, now: float) -> float:
        since = [t for t in (model.last_request_s, instance.ready_s) if t is not None]
        return max(0.0, now - max(since)) if since else 0.0

    def start_overhead_s(self) -> float:
        """A start's fixed cost: the median, over the last starts seen ready, of their load time
        beyond placement's read estimate (the config's default before any was seen)."""
        for instance in self._instances.all():
            if instance.load_s is not None and instance.instance_id not in self._sampled_starts:
                self._sampled_starts[instance.instance_id] = None
                while len(self._sampled_starts) > 4 * MAX_START_SAMPLES:
                    self._sampled_starts.popitem(last=False)
                self._start_overheads.append(max(0.0, instance.load_s - (instance.estimate_s or 0.0)))
        if self._start_overheads:
            return statistics.median(self._start_overheads)
        return self.config.slot_sharing.eviction.start_overhead_s if self.config.slot_sharing else 1.0

    def _reload(self, instance: ManagedInstance, model: ModelState, overhead_s: float) -> tuple[str, float]:
        """Where the instance's checkpoint would come back from on its node, and how long a start
        from there takes (the fixed overhead plus the read)."""
        node = self._nodes.get(instance.node_id)
        report = node.report if node is not None else None
        rates = tier_bandwidths(report, self.config)
        num_bytes = model.num_bytes or 1
        name = instance.repository_name
        dram = report.tier("dram") if report is not None and rates.dram_bytes_per_s else None
        if dram is not None and (name in dram.models or dram_can_take(report, name, num_bytes, self.config)):
            return "dram", overhead_s + num_bytes / rates.dram_bytes_per_s
        if report is not None and rates.ssd_bytes_per_s and name in report.tier("ssd").models:
            return "ssd", overhead_s + num_bytes / rates.ssd_bytes_per_s
        return "repository", overhead_s + num_bytes / rates.repository_bytes_per_s

    def _eviction_candidates(self, now: float) -> list[EvictionCandidate]:
        draining = self._draining_nodes()
        overhead_s = self.start_overhead_s()
        candidates = []
        for instance in self._instances.all():
            model = self._models.get(instance.model_id)
            if model is None:
                continue
            tier, reload_s = self._reload(instance, model, overhead_s)
            candidates.append(EvictionCandidate(
                instance_id=instance.instance_id, model_id=instance.model_id, node_id=instance.node_id,
                num_worker_slots=instance.num_worker_slots, memory_bytes=instance.held_memory_bytes,
                ready=instance.phase is InstanceState.READY, asleep=instance.phase is InstanceState.ASLEEP,
                holds_slot=instance.holds_slot,
                num_ongoing_requests=instance.num_ongoing_requests, num_queued_requests=self._queued(model, now),
                idle_s=self._idle_s(instance, model, now),
                num_model_instances=len(self._instances.live(instance.model_id)),
                min_instances=model.spec.autoscaling.min_instances, priority=model.spec.autoscaling.priority,
                frequency=model.usage.value(now), reload_s=reload_s, reload_tier=tier,
                draining=instance.node_id in draining))
        return candidates

    def _preemption_candidates(self, now: float) -> list[PreemptionCandidate]:
        draining = self._draining_nodes()
        instances = self._instances.all()
        candidates = []
        for instance in instances:
            model = self._models.get(instance.model_id)
            if model is None:
                continue
            destination, _ = choose_destination(instance, instances, draining)
            candidates.append(PreemptionCandidate(
                instance_id=instance.instance_id, model_id=instance.model_id, node_id=instance.node_id,
                num_worker_slots=instance.num_worker_slots, ready=instance.phase is InstanceState.READY,
                num_ongoing_requests=instance.num_ongoing_requests,
                ready_for_s=now - instance.ready_s if instance.ready_s is not None else 0.0,
                priority=model.spec.autoscaling.priority,
                destination_instance_id=destination.instance_id if destination is not None else None,
                draining=instance.node_id in draining))
        return candidates

    def _holders_with_scores(self, now: float) -> list[tuple[SlotHolder, float | None]]:
        """Every instance as a slot holder, with its eviction score (None without slot sharing)."""
        settings = self.config.slot_sharing
        candidates = {c.instance_id: c for c in self._eviction_candidates(now)}
        rows = []
        for instance in self._instances.all():
            candidate = candidates.get(instance.instance_id)
            idle = candidate is not None and candidate.ready and not candidate.num_ongoing_requests
            score = eviction_score(candidate, settings.eviction) if candidate and settings else None
            rows.append((SlotHolder(node_id=instance.node_id, instance_id=instance.instance_id,
                                    model_id=instance.model_id, state=instance.phase.value,
                                    num_ongoing_requests=instance.num_ongoing_requests,
                                    idle_s=candidate.idle_s if idle else None), score))
        return rows
