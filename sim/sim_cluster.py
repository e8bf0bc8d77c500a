"""The simulated cluster: nodes of accelerators with DRAM and SSD tiers, and the model instances on them.

What it models (and what a policy drives through its public methods):

- Nodes: `gpus_per_node` slots each, a DRAM and an SSD checkpoint cache (`storage.TierLedger`, the node store's LRU, byte
  budgets) and one loader (`SimNode`, `sim.node_loader`). A load from the SSD or the repository
  (S3) queues on the node's loader (they share the disk and the NIC); a load from DRAM (over each GPU's own PCIe link) or a
  peer's stream does not. Starts of one model on one node while its repository fetch is in
  flight share that fetch (the node store's single flight) and are ready when it lands.
- Instances (`SimInstance`): a model needing k accelerators (`cost.accelerators_needed`) takes k
  slots of one node from the moment it starts (LOADING) until it is gone. A load from tier T
  takes `cost.load_s(weight_bytes, T)` plus the node loader's wait plus `start_overhead_s`. A
  stream from a running peer (BlitzScale's zig-zag) takes `cost.load_s(bytes, "gpu")` from a
  peer on the same node or `"remote"` from another node, and the instance serves once
  `stream_serve_fraction` of that has passed (its first layers arrived; the stated model of
  zig-zag: prompts run through the layers present while the rest arrive). After a load the
  checkpoint is kept in the node's SSD (when it came from the repository) and DRAM tiers,
  unless the policy keeps no node copies (Ray Serve reads the repository every time).
- Slot hosts (`ClusterSpec.models_per_gpu` above 1, `sim.slot_hosts`): each GPU holds several
  instances as far as their weights and KV pools fit its memory; `room(node, model)` and
  `slots_freed_for` count a GPU as room only where the model's share fits, so the policies' slot
  counts are memory-aware; co-resident decode steps take turns; an idle instance may `sleep`
  (keeping its places, none of the GPU's memory) and `wake`; a GPU is counted once.
- Spare workers and DRAM promotion (`sim.node_upkeep`, off by default): a start without a warm
  spare pays `process_start_s` more, and with `promote_on_settle` the DRAM copy is made once the
  node has settled rather than at once (the controller's `SparePool` and `CheckpointCopies`).
- Requests: each model has one FIFO queue (the gateway's). A request goes to the least-loaded
  READY instance of its model with room (`max_batch` in flight), else waits in the queue;
  every finish and every instance becoming ready pulls from it.
- Suspension (a preempted instance's requests back to the head of their queue, resumed by their
  tokens) and live migration (to another instance, after `cost.migration_pause_s`; KV-based:
  decode continues, token-based: the destination recomputes the KV by a prefill). Migrated
  requests beyond the destination's free batch seats (`max_batch`) go back to the head of their
  model's queue for the next seat, as vLLM keeps requests past `max_num_seqs` waiting.

The cluster calls its policy back (`on_queued`, `on_demand`, `on_ready`, `on_idle`,
`on_released`) so the policy keeps its own dirty set; it takes no decision itself. Accounting:
accelerator-seconds (slots held x time, loading and idle included; on slot hosts, GPUs in use x time), cold starts by tier,
evictions, migrations, and each request's TTFT (plus `request_overhead_s`, the path outside the
instance).
"""

from __future__ import annotations

import heapq
import math
from array import array

from sim.event_loop import EventLoop
from sim.cluster_spec import ClusterSpec
from sim.node_upkeep import NodeUpkeep
from sim.sim_host import SimHost
from sim.slot_hosts import SlotHosts
from sim.node_loader import join, node_loader
from sim.sim_instance import Flight, SimInstance
from sim.sim_model_state import SimModelState
from sim.sim_node import SimNode
from storage.tier_ledger import TierLedger
from wire import InstanceState

__all__ = ["SimCluster", "COLD_START_TIERS"]

GIB = 1 << 30
COLD_START_TIERS = ("gpu", "remote", "dram", "ssd", "s3")
_SHARED_TIERS = frozenset({"ssd", "s3"})  # loads that share the node's disk/NIC path (`sim.node_loader`)


class SimCluster:
    """See the module docstring. A start with `node_index` None gets its own virtual node (no slot
    limit, no load): the lower bound's cluster. `memoise_costs=False` makes every instance call
    the cost model's checked methods (the reference the fast path is tested against)."""

    def __init__(self, spec: ClusterSpec, models, cost, gpu, loop: EventLoop, num_requests: int = 0, *,
                 memoise_costs: bool = True) -> None:
        self.spec = spec
        self.cost = cost
        self.gpu = gpu
        self.loop = loop
        hosts = spec.slot_hosts
        self.nodes = [SimNode(i, spec.gpus_per_node, spec.dram_bytes_per_node, spec.ssd_bytes_per_node,
                              node_loader(loop, spec.concurrent_loads, spec.short_fetch_ratio),
                              [SimHost(g, spec.gpu_memory_bytes, spec.models_per_gpu)
                               for g in range(spec.gpus_per_node)] if hosts else None)
                      for i in range(spec.num_nodes)]
        self.models = [SimModelState(i, m, cost.accelerators_needed(m, gpu),
                                     cost.instance_costs(m, gpu, memoise=memoise_costs)) for i, m in enumerate(models)]
        self.hosts = SlotHosts(spec, self.models, cost, gpu) if hosts else None
        self.model_index = {m.model_id: i for i, m in enumerate(models)}
        self.instances: dict[int, SimInstance] = {}  # index -> live or stopping instance
        self.policy = None
        self.keep_copies = True
        self.num_free_slots = spec.num_nodes * spec.gpus_per_node
        self._used_slots = 0  # slots held by instances off slot hosts
        self.ttft_s = array("d", [math.nan]) * num_requests
        self.finish_s = array("d", [math.nan]) * num_requests
        self._accelerator_s = 0.0  # of instances off slot hosts (the hosts count their GPUs)
        self.cold_starts = dict.fromkeys(COLD_START_TIERS, 0)
        self.counts = {"evictions": 0, "migrations": 0, "requests_migrated": 0, "preemptions": 0,
                       "requests_suspended": 0, "dram_cache_evictions": 0, "ssd_cache_evictions": 0,
                       "requests_timed_out": 0}
        if hosts:
            self.counts.update(sleeps=0, wakes=0)
        self.num_finished = 0  # requests served to their last token (timed-out ones are counted apart)
        self._next_instance = 0
        # Indexes for placement at scale: nodes by free slot count, and the nodes holding a copy.
        self._free_buckets: list[set[int]] = [set() for _ in range(spec.gpus_per_node + 1)]
        self._free_buckets[spec.gpus_per_node].update(range(spec.num_nodes))
        self._copies: dict[int, set[int]] = {}
        self.upkeep = NodeUpkeep(self)

    @property
    def num_used_slots(self) -> int:
        """Slots held now (on slot hosts: GPUs with an awake instance)."""
        return self._used_slots + (self.hosts.num_in_use if self.hosts is not None else 0)

    @property
    def num_awake_instances(self) -> int:
        """Instances not asleep (a sleeper holds host memory and a place, no accelerator time)."""
        return len(self.instances) - sum(len(node.sleepers) for node in self.nodes)

    @property
    def accelerator_s(self) -> float:
        return self._accelerator_s + (self.hosts.accelerator_s if self.hosts is not None else 0.0)

    def attach(self, policy) -> None:
        self.policy = policy
        self.keep_copies = policy.keeps_node_copies

    # --- requests ----------------------------------------------------------------------------

    def arrive(self, index: int, model_index: int, input_tokens: int, output_tokens: int) -> None:
        """A request arrives now (an event callback)."""
        now = self.loop.now
        if index >= len(self.ttft_s):
            grow = index + 1 - len(self.ttft_s)
            self.ttft_s.extend([math.nan] * grow)
            self.finish_s.extend([math.nan] * grow)
        flight = Flight(index, model_index, now, input_tokens, output_tokens)
        state = self.models[model_index]
        state.last_request_s = now
        state.num_requests += 1
        state.queue.append(flight)
        self._route(state, now)
        if state.queue:
            if self.spec.queue_timeout_s is not None:
                self.loop.schedule_in(self.spec.queue_timeout_s, self._time_out, flight)
            self.policy.on_queued(state)
        self.policy.on_demand(state)

    @property
    def num_done(self) -> int:
        """Requests that will not come back: served to their end, or failed by the queue timeout."""
        return self.num_finished + self.counts["requests_timed_out"]

    def _time_out(self, flight: Flight) -> None:
        """`queue_timeout_s` after its arrival: a request still queued and never admitted fails (a
        suspended one, which has its first token, and one admitted meanwhile are left alone)."""
        state = self.models[flight.model_index]
        if flight.first_token_s is not None or flight.requeued or flight not in state.queue:
            return
        state.queue.remove(flight)
        self.counts["requests_timed_out"] += 1  # never served: its TTFT stays NaN
        self.policy.on_demand(state)

    def _route(self, state: SimModelState, now: float) -> None:
        queue = state.queue
        ready = InstanceState.READY
        while queue:
            best = None
            fewest = self.spec.max_batch  # an instance with room has fewer in flight
            for instance in state.instances:
                if instance.num_ongoing < fewest and instance.phase == ready:
                    best, fewest = instance, instance.num_ongoing
            if best is None:
                return
            flight = queue.popleft()
            state.num_ongoing += 1
            best.admit(flight, now)
            self.policy.on_started(state, now)

    def _finished(self, instance: SimInstance, flight: Flight, now: float) -> None:
        self.ttft_s[flight.index] = flight.first_token_s - flight.arrival_s + self.spec.request_overhead_s
        self.finish_s[flight.index] = now
        self.num_finished += 1
        state = self.models[flight.model_index]
        state.num_ongoing -= 1
        state.last_request_s = now
        if instance.phase == InstanceState.STOPPING:
            if instance.num_ongoing == 0:
                self._wind_down(instance, now)
        else:
            self._route(state, now)
            if instance.num_ongoing == 0:
                instance.busy_since_s = None
                instance.idle_since_s = now
                self.policy.on_idle(instance)
        self.policy.on_demand(state)

    # --- instances ---------------------------------------------------------------------------

    def nodes_with_room(self, num_slots: int, limit: int, model_index: int | None = None) -> list[SimNode]:
        """Up to `limit` nodes with at least `num_slots` free, emptiest first (then lowest index).
        On slot hosts, for `model_index`: the nodes whose roomiest GPU fits its share, free loaders
        first (`SlotHosts.nodes_with_room`; a GPU's free place says nothing of its memory)."""
        if self.hosts is not None and model_index is not None:
            return self.hosts.nodes_with_room(self.nodes, model_index, limit, self.loop.now)
        found: list[SimNode] = []
        for free in range(self.spec.gpus_per_node, num_slots - 1, -1):
            bucket = self._free_buckets[free]
            if bucket:
                want = limit - len(found)
                picked = sorted(bucket) if len(bucket) <= want else heapq.nsmallest(want, bucket)
                found.extend(self.nodes[i] for i in picked)
                if len(found) >= limit:
                    break
        return found

    def nodes_holding(self, model_index: int) -> list[SimNode]:
        """Nodes with the model's checkpoint in DRAM or SSD, by index."""
        return [self.nodes[i] for i in sorted(self._copies.get(model_index, ()))]

    def room(self, node: SimNode, model_index: int) -> int:
        """The slots the node has for one more instance of the model (it needs `num_slots`): its
        free GPUs, or on slot hosts its GPUs with a free place and the memory for the model's share."""
        return node.free_slots if node.hosts is None else self.hosts.room(node, model_index)

    def slots_freed_for(self, instance: SimInstance, model_index: int) -> int:
        """What stopping `instance` adds to `room(its node, model_index)`: its slots, or on slot
        hosts those of its GPUs that the model's share does not fit now and would once it left."""
        return self.hosts.freed_for(instance, model_index) if instance.hosts else instance.num_slots

    def _refresh_free(self, node: SimNode) -> None:
        free = self.hosts.refresh(node)
        self.num_free_slots += free - node.free_slots
        self._set_free(node, free)

    def _set_free(self, node: SimNode, free_slots: int) -> None:
        self._free_buckets[node.free_slots].discard(node.index)
        node.free_slots = free_slots
        self._free_buckets[free_slots].add(node.index)

    def _keep_copy(self, node: SimNode, tier: TierLedger, model_index: int, num_bytes: int, counter: str) -> None:
        evicted = tier.keep(model_index, num_bytes)
        if model_index in tier:
            self._copies.setdefault(model_index, set()).add(node.index)
        self.counts[counter] += len(evicted)
        for old in evicted:
            if old not in node.dram and old not in node.ssd:
                holders = self._copies.get(old)
                if holders is not None:
                    holders.discard(node.index)

    def preload(self, node_index: int, model_index: int, tier: str) -> None:
        """Put the model's checkpoint in a node's "dram" or "ssd" tier before the run (a warm cache)."""
        if tier not in ("dram", "ssd"):
            raise ValueError(f"a node keeps checkpoints in 'dram' or 'ssd', not {tier!r}")
        node = self.nodes[node_index]
        self._keep_copy(node, node.dram if tier == "dram" else node.ssd, model_index,
                        self.models[model_index].model.weight_bytes, f"{tier}_cache_evictions")

    def stage(self, node_index: int, model_indices: list[int], tier: str) -> list[int]:
        """Before the run, fill a node's "dram" or "ssd" tier with the first of `model_indices`
        that fit, in that order, none evicting another (the order is what the cluster served most,
        `sim.simulator`'s staging); the first ends most recently used, so the run's own copies
        evict the last first. Returns the models staged."""
        if tier not in ("dram", "ssd"):
            raise ValueError(f"a node keeps checkpoints in 'dram' or 'ssd', not {tier!r}")
        node = self.nodes[node_index]
        cache = node.dram if tier == "dram" else node.ssd
        room = cache.capacity_bytes - cache.used_bytes
        chosen = []
        for model_index in model_indices:
            num_bytes = self.models[model_index].model.weight_bytes
            if 0 < num_bytes <= room and model_index not in cache:
                chosen.append(model_index)
                room -= num_bytes
        for model_index in reversed(chosen):
            self._keep_copy(node, cache, model_index, self.models[model_index].model.weight_bytes,
                            f"{tier}_cache_evictions")
        return chosen

    def keep_dram_copy(self, node: SimNode, model_index: int) -> None:
        """A copy of the model lands in the node's DRAM tier (a promotion, `sim.node_upkeep`)."""
        self._keep_copy(node, node.dram, model_index, self.models[model_index].model.weight_bytes,
                        "dram_cache_evictions")

    def checkpoint_tiers(self, node: SimNode, model_index: int) -> tuple[str, ...]:
        """The node tiers holding the model, fastest first."""
        tiers = ()
        if model_index in node.dram:
            tiers += ("dram",)
        if model_index in node.ssd:
            tiers += ("ssd",)
        return tiers

    def start_instance(self, model_index: int, node_index: int | None, tier: str, *,
                       stream_from: SimInstance | None = None) -> SimInstance:
        """Take the slots and begin the load (from `tier`, or streamed from a peer instance).
        `node_index` None: the unbounded cluster's own virtual node, weights already resident."""
        now = self.loop.now
        state = self.models[model_index]
        weight_bytes = state.model.weight_bytes
        resident_s = now
        from_spare = False
        job = None  # the node loader's load this instance waits for, if any
        if node_index is None:
            node_index, load_s, tier = -1, 0.0, "gpu"
        else:
            node = self.nodes[node_index]
            if self.room(node, model_index) < state.num_slots:
                raise ValueError(f"{node.node_id} has room for {self.room(node, model_index)} of the "
                                 f"{state.num_slots} slots {state.model_id} needs")
            if node.hosts is None:
                self._set_free(node, node.free_slots - state.num_slots)
                self.num_free_slots -= state.num_slots
                from_spare = self.upkeep.take_spare(node)
                overhead_s = self.spec.start_overhead_s + (0.0 if from_spare else self.spec.process_start_s)
            else:  # a slot host is a warm process: the model's engine start alone
                overhead_s = self.spec.start_overhead_s
            if stream_from is not None:
                tier = "gpu" if stream_from.node_index == node_index else "remote"
                stream_s = self.cost.load_s(weight_bytes, tier)
                resident_s = now + stream_s + overhead_s
                load_s = stream_s * self.spec.stream_serve_fraction
            elif tier == "s3" and self.keep_copies and model_index in node.fetches \
                    and node.fetches[model_index].end_s > now:  # the node store's single flight: one fetch
                job = node.fetches[model_index]
                if job.delay_s is not None:  # a queued fetch: its end is known
                    load_s, job = job.end_s - now, None
            else:
                load_s = self.cost.load_s(weight_bytes, tier)
                if tier in _SHARED_TIERS:
                    job = node.loader.start(load_s)
                    if tier == "s3" and self.keep_copies:
                        node.fetches[model_index] = job
                    if job.delay_s is not None:
                        load_s, job = job.delay_s, None
                if tier == "dram" and model_index in node.dram:
                    node.dram.touch(model_index)
                elif tier == "ssd" and model_index in node.ssd:
                    node.ssd.touch(model_index)
            if job is None:
                load_s += overhead_s
        if node_index < 0 or self.nodes[node_index].hosts is None:
            self._used_slots += state.num_slots  # on slot hosts: counted by GPU (`SlotHosts`)
        if node_index >= 0:  # the unbounded cluster's instances are warm by assumption
            self.cold_starts[tier] += 1
        self._next_instance += 1
        instance = SimInstance(instance_id=f"{state.model_id}#{self._next_instance}", index=self._next_instance,
                               model_index=model_index, node_index=node_index, num_slots=state.num_slots,
                               tier=tier, started_s=now, max_batch=self.spec.max_batch, loop=self.loop,
                               costs=state.costs, on_finish=self._finished)
        instance.stream_source = stream_from.instance_id if stream_from is not None else None
        instance.from_spare = from_spare
        instance.resident_s = resident_s if stream_from is not None else math.inf if job is not None else now + load_s
        if node_index >= 0 and self.nodes[node_index].hosts is not None:
            self.hosts.place(instance, self.nodes[node_index], now)
            self._refresh_free(self.nodes[node_index])
        self.instances[instance.index] = instance
        state.instances.append(instance)
        state.num_loading += 1
        if job is not None:
            join(job, self._loaded, instance, overhead_s)
        elif load_s == 0.0:
            self._ready(instance)
        else:
            instance.load_event = self.loop.schedule(now + load_s, self._ready, instance, priority=0)
        return instance

    def _loaded(self, instance: SimInstance, overhead_s: float) -> None:
        """A shared loader has read the instance's checkpoint: its engine starts (`overhead_s`),
        unless it was stopped meanwhile."""
        if instance.phase != InstanceState.LOADING:
            return
        now = self.loop.now
        instance.resident_s = now + overhead_s
        if overhead_s <= 0.0:
            self._ready(instance)
        else:
            instance.load_event = self.loop.schedule(now + overhead_s, self._ready, instance, priority=0)

    def _ready(self, instance: SimInstance) -> None:
        now = self.loop.now
        instance.load_event = None
        self.models[instance.model_index].num_loading -= 1
        instance.phase = InstanceState.READY
        instance.ready_s = now
        instance.idle_since_s = now
        state = self.models[instance.model_index]
        if instance.node_index >= 0 and self.keep_copies and instance.tier != "host":  # a wake reads no tier
            node = self.nodes[instance.node_index]
            nbytes = state.model.weight_bytes
            if instance.tier == "s3":
                self._keep_copy(node, node.ssd, instance.model_index, nbytes, "ssd_cache_evictions")
            if not self.spec.promote_on_settle or instance.tier == "dram":
                self._keep_copy(node, node.dram, instance.model_index, nbytes, "dram_cache_evictions")
        if instance.node_index >= 0:
            self.upkeep.ready(instance, self.nodes[instance.node_index])
        self._route(state, now)
        self.policy.on_ready(instance)
        if instance.num_ongoing == 0:
            self.policy.on_idle(instance)

    def stop_instance(self, instance: SimInstance) -> None:
        """Stop: at once when it has no request (or is still loading), else once they finish."""
        if instance.phase == InstanceState.STOPPING:
            return
        state = self.models[instance.model_index]
        if instance.phase == InstanceState.ASLEEP:
            state.sleepers.remove(instance)
            del self.nodes[instance.node_index].sleepers[instance.index]
        else:
            state.instances.remove(instance)
        if instance.phase == InstanceState.LOADING:
            state.num_loading -= 1
        instance.phase = InstanceState.STOPPING
        if instance.num_ongoing == 0:
            self._wind_down(instance, self.loop.now)

    def _wind_down(self, instance: SimInstance, now: float) -> None:
        """A stopping instance has no request left: its slot is free once its worker has stopped
        (`stop_s`, or `recycle_s` when the worker goes back to the spare pool)."""
        delay_s = self.spec.stop_s
        if instance.node_index >= 0 and self.upkeep.would_recycle(instance, self.nodes[instance.node_index]):
            delay_s = self.spec.recycle_s
        if delay_s <= 0:
            self._release(instance, now)
        else:
            instance.stop()  # no events of its own meanwhile
            self.loop.schedule(now + delay_s, self._released_later, instance, priority=0)

    def _released_later(self, instance: SimInstance) -> None:
        self._release(instance, self.loop.now)

    def sleep(self, instance: SimInstance) -> None:
        """An idle ready instance on slot hosts sleeps: its GPUs' memory is free, its places kept
        (its weights in host memory), and it serves nothing until it `wake`s."""
        if not instance.hosts or instance.phase != InstanceState.READY or instance.num_ongoing:
            raise ValueError(f"{instance.instance_id} cannot sleep: only an idle ready instance on a slot host can")
        state = self.models[instance.model_index]
        state.instances.remove(instance)
        state.sleepers.append(instance)
        self.nodes[instance.node_index].sleepers[instance.index] = instance
        instance.phase = InstanceState.ASLEEP
        self.hosts.sleep(instance, self.loop.now)
        self._refresh_free(self.nodes[instance.node_index])
        self.counts["sleeps"] += 1

    def wake(self, instance: SimInstance) -> None:
        """A sleeper whose GPUs have the memory for it again serves once its weights are back."""
        if instance.phase != InstanceState.ASLEEP or not self.hosts.can_wake(instance):
            raise ValueError(f"{instance.instance_id} cannot wake: it is not asleep, or its GPUs lack the memory")
        now = self.loop.now
        state = self.models[instance.model_index]
        state.sleepers.remove(instance)
        del self.nodes[instance.node_index].sleepers[instance.index]
        state.instances.append(instance)
        state.num_loading += 1
        instance.phase = InstanceState.LOADING
        instance.tier = "host"
        instance.resident_s = now + self.hosts.wake(instance, now)
        self._refresh_free(self.nodes[instance.node_index])
        instance.load_event = self.loop.schedule(instance.resident_s, self._ready, instance, priority=0)
        self.counts["wakes"] += 1

    def evict(self, instance: SimInstance) -> None:
        """Stop an idle instance for another model (counted as an eviction)."""
        self.counts["evictions"] += 1
        self._stopping_for_another(instance)
        self.stop_instance(instance)

    def suspend(self, instance: SimInstance) -> None:
        """Preempt by suspension: its requests go back to the head of their model's queue (resumed
        by their tokens: the next instance recomputes their KV), and it stops at once."""
        now = self.loop.now
        state = self.models[instance.model_index]
        flights = instance.take_all(now)
        state.num_ongoing -= len(flights)
        for flight in reversed(flights):
            flight.queued_s = now
            flight.requeued = True
            flight.needs_prefill = True
            state.queue.appendleft(flight)
        self.counts["preemptions"] += 1
        self.counts["requests_suspended"] += len(flights)
        self._stopping_for_another(instance)
        self.stop_instance(instance)
        if state.queue:
            self.policy.on_queued(state)
        self.policy.on_demand(state)

    def migrate(self, instance: SimInstance, destination: SimInstance, *, token_based: bool) -> None:
        """Live-migrate every request of `instance` to `destination` (another instance of its model)
        and stop `instance`: the requests pause `cost.migration_pause_s` and continue there (KV-based:
        decode goes on; token-based: the destination first recomputes their KV)."""
        now = self.loop.now
        state = self.models[instance.model_index]
        flights = instance.take_all(now)
        context = sum(f.input_tokens + f.generated_tokens for f in flights)
        pause_s = self.cost.migration_pause_s(state.model, self.gpu, max(1, len(flights)), context,
                                              "tokens" if token_based else "kv")
        self.counts["migrations"] += 1
        self.counts["requests_migrated"] += len(flights)
        self._stopping_for_another(instance)
        self.stop_instance(instance)
        self.loop.schedule(now + pause_s, self._land, state, destination, flights, token_based)

    def _stopping_for_another(self, instance: SimInstance) -> None:
        """Its slot goes to another model: its worker may go back to the spare pool."""
        instance.recycle = True
        if instance.node_index >= 0:
            self.upkeep.stopping_for_another(instance, self.nodes[instance.node_index])

    def _land(self, state: SimModelState, destination: SimInstance, flights: list[Flight], token_based: bool) -> None:
        now = self.loop.now
        back = []
        for flight in flights:
            # Taken mid-prefill (`take_all`: no first token yet), it is prefilled again here
            # whenever it lands: its KV was not whole, and its first token is still to come.
            flight.needs_prefill = token_based or flight.first_token_s is None or now < flight.prefill_end_s
            if destination.has_room:
                destination.admit(flight, now)
            else:  # the destination went away meanwhile, or its batch is full (vLLM's max_num_seqs):
                state.num_ongoing -= 1  # back to the head of the queue, in order, for the next seat
                flight.queued_s = now
                flight.requeued = True
                back.append(flight)
        state.queue.extendleft(reversed(back))
        self._route(state, now)
        if state.queue:
            self.policy.on_queued(state)
        self.policy.on_demand(state)

    def _release(self, instance: SimInstance, now: float) -> None:
        if self.instances.pop(instance.index, None) is None:
            return  # already gone (several of its requests finished in one step)
        instance.stop()
        if instance.hosts:
            self.hosts.remove(instance, now)
            self._refresh_free(self.nodes[instance.node_index])
            self.policy.on_released(instance)
            return
        self._accelerator_s += (now - instance.started_s) * instance.num_slots
        self._used_slots -= instance.num_slots
        if instance.node_index >= 0:
            node = self.nodes[instance.node_index]
            self._set_free(node, node.free_slots + instance.num_slots)
            self.num_free_slots += instance.num_slots
            self.upkeep.released(instance, node)
        self.policy.on_released(instance)

    def close(self, now: float) -> None:
        """End of the run: the slots still held count until now."""
        for instance in self.instances.values():
            if not instance.hosts:  # on slot hosts a GPU is counted while anything is on it
                self._accelerator_s += (now - instance.started_s) * instance.num_slots
        if self.hosts is not None:
            self._accelerator_s += self.hosts.close(self.nodes, now)
