"""An in-memory `ClusterClient` for the controller's unit tests: nodes, node stores and workers
as plain objects whose behaviour each test sets (a worker that loads until told, one that fails,
a store whose DRAM is full, a node list that fails once).

Handles are the fake objects themselves. Everything is recorded (pins, unpins, invalidations,
started and stopped workers), so tests assert exactly what the controller asked for.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from controller import ActorGoneError, ClusterClient, RayNodeInfo
from wire import HostedInstance
from storage import BandwidthReport, NodeStoreConfig, NodeStoreReport, TierEntryReport, TierFullError, TierReport
from storage.node_settings import NodeSettings


@dataclass
class FakeStats:
    state: str
    num_ongoing_requests: int
    num_generated_tokens: int
    load_s: float
    weights_resident: bool = True
    prefills_at_frontier: tuple[str, ...] = ()
    num_requests_started: int = 0
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    kv_cache_usage: float = 0.0


@dataclass(frozen=True)
class FakeTicket:
    """What `stream_weights` hands out: the source, the chain's length, the receiver's rank."""

    source_instance_id: str
    num_receivers: int
    rank: int = 1

    def for_rank(self, rank: int) -> FakeTicket:
        assert 1 <= rank <= self.num_receivers
        return FakeTicket(self.source_instance_id, self.num_receivers, rank)


@dataclass
class FakeLoad:
    load_s: float
    weights_pack_s: float = 0.0


@dataclass
class FakeWorker:
    instance_id: str
    model_id: str
    model_dir: str
    actor_name: str
    ray_node_id: str
    num_cpus: float
    engine_config: Any
    state: str = "loading"
    num_ongoing_requests: int = 0
    num_generated_tokens: int = 0
    alive: bool = True
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    load_error: Exception | None = None
    stats_delay_s: float = 0.0
    num_threads: int | None = None
    num_gpus: float = 0.0  # the Ray GPUs it reserves (a GPU node's slot host: 1)
    reserved_bytes: tuple[int, int] | None = None  # a spare's (weight, KV) reservation once warmed
    request_ids: list[str] = field(default_factory=list)  # open requests, for migration
    peer: Any = None  # the ticket of the stream it takes its weights from
    fallback_dir: str | None = None  # supplied by the controller once the node's copy is pinned
    weights_resident: bool = True
    stream_error: Exception | None = None  # stream_weights raises this when set
    prefills_at_frontier: tuple[str, ...] = ()  # reported prompts waiting for a layer (streamed instances)
    num_requests_started: int = 0  # requests given to it so far (its usage)
    num_running_requests: int = 0  # its engine's batch, queue and KV use, as reported
    num_waiting_requests: int = 0
    kv_cache_usage: float = 0.0

    def finish_loading(self, error: Exception | None = None) -> None:
        self.load_error = error
        self.state = "failed" if error else "ready"
        self.loaded.set()


@dataclass(frozen=True)
class FakeParked:
    """A parked request as `park_requests` returns it (the real one is a `migration.ParkedRequest`)."""

    request_id: str
    num_bytes: int


@dataclass
class FakeStore:
    node_id: str
    config: NodeStoreConfig
    model_bytes: dict[str, int] = field(default_factory=dict)  # what entries weigh
    tiers: dict[str, dict[str, bool]] = field(default_factory=lambda: {"dram": {}, "ssd": {}})  # model -> pinned
    dram_full: bool = False
    alive: bool = True
    unpins: list[tuple[str, str]] = field(default_factory=list)
    prefetches: list[tuple[str, str]] = field(default_factory=list)  # the copies made
    num_prefetch_calls: int = 0  # ... and the calls, refused ones included
    invalidations: list[tuple[str, str]] = field(default_factory=list)
    closed: bool = False

    def hold(self, model: str, tier: str, pinned: bool = False) -> None:
        self.tiers[tier][model] = pinned
        if tier == "dram":
            self.tiers["ssd"].setdefault(model, False)

    def report(self) -> NodeStoreReport:
        tiers = tuple(
            TierReport(tier=tier, path=f"/fake/{self.node_id}/{tier}",
                       capacity_bytes=self.config.dram_capacity_bytes if tier == "dram" else self.config.ssd_capacity_bytes,
                       used_bytes=sum(self.model_bytes.get(m, 1) for m in models),
                       entries=tuple(TierEntryReport(model=m, num_bytes=self.model_bytes.get(m, 1), last_used_s=0.0,
                                                     pinned=pinned, num_loading=0) for m, pinned in models.items()))
            for tier, models in self.tiers.items())
        return NodeStoreReport(platform_id=self.config.platform_id, node_id=self.node_id, tiers=tiers,
                               bandwidth=BandwidthReport(None, None, None, measured_at=0.0), num_fetches=0,
                               num_conversions=0, reported_at=time.time(),
                               worker_memory_bytes=self.config.worker_memory_bytes)


class FakeCluster(ClusterClient):
    """See the module docstring. `auto_ready`: workers finish loading as soon as they start."""

    def __init__(self, ray_node_ids: tuple[str, ...] = ("a" * 56,), namespace: str = "fake-ns",
                 auto_ready: bool = True) -> None:
        self.namespace = namespace
        self.ray_nodes = [RayNodeInfo(node_id) for node_id in ray_node_ids]
        self.auto_ready = auto_ready
        self.workers: dict[str, FakeWorker] = {}  # actor name -> worker (alive or not)
        self.stores: dict[str, FakeStore] = {}
        self.num_started_workers = 0
        self.stopped_workers: list[str] = []
        self.released_workers: list[str] = []  # instances whose worker let its model go (back to the spare pool)
        self.slept_workers: list[str] = []  # instances put to sleep, in order
        self.woken_workers: list[str] = []  # instances woken, in order
        self.refuse_sleep: set[str] = set()  # instance ids whose sleep fails (a request raced it)
        self.killed_workers: list[str] = []
        self.migrations: list[tuple[str, str, list[str], str]] = []  # (source, destination, request ids, method)
        self.suspensions: list[tuple[str, list[str]]] = []  # (instance, request ids suspended)
        self.parkings: list[tuple[str, list[str]]] = []  # (instance, request ids parked with their KV)
        self.replays: list[tuple[str, list[str]]] = []  # (instance, request ids replayed into it)
        self.kv_bytes: dict[str, int] = {}  # request id -> its KV's size when parked (default 1000)
        self.refuse_replay: set[str] = set()  # request ids a replay fails for
        self.spares: dict[str, FakeWorker] = {}  # actor name -> unassigned spare
        self.hosted: dict[str, FakeWorker] = {}  # instance id -> an instance in a slot host (`HostedInstance`)
        self.spares_warm = asyncio.Event()  # set: spares answer warm()
        self.assigned_spares: list[str] = []
        self.killed_spares: list[str] = []
        self.list_nodes_failures = 0
        self.model_bytes: dict[str, int] = {}
        self.streams: list[tuple[str, int]] = []  # (source instance id, receivers) per stream_weights
        self.pin_gate: asyncio.Event | None = None  # set by a test: pins wait for it
        self.stop_gate: asyncio.Event | None = None  # set by a test: stops and releases wait for it
        self.node_settings: dict[str, NodeSettings] = {}  # Ray node id -> its own settings (`thaw join`)

    async def list_nodes(self) -> list[RayNodeInfo]:
        if self.list_nodes_failures > 0:
            self.list_nodes_failures -= 1
            raise ConnectionError("GCS unreachable (injected)")
        return list(self.ray_nodes)

    # --- node stores ------------------------------------------------------------------------

    async def connect_node_store(self, node_id: str, ray_node_id: str, config: NodeStoreConfig) -> Any:
        store = self.stores.get(node_id)
        if store is None or not store.alive:
            config = self.node_settings.get(ray_node_id, NodeSettings()).apply(config)  # as the store actor does
            store = self.stores[node_id] = FakeStore(node_id, config, self.model_bytes)
        return store

    async def node_store_report(self, store: FakeStore, timeout_s: float) -> NodeStoreReport:
        if not store.alive:
            raise ActorGoneError(f"store {store.node_id} is dead")
        return store.report()

    async def pin_checkpoint(self, store: FakeStore, model: str, tier: str, timeout_s: float) -> str:
        if tier == "dram" and store.dram_full and model not in store.tiers["dram"]:
            raise TierFullError(f"dram of {store.node_id} is full (injected)")
        if self.pin_gate is not None:
            await self.pin_gate.wait()
        store.hold(model, tier, pinned=True)
        return f"/fake/{store.node_id}/{tier}/{model}"

    async def prefetch_checkpoint(self, store: FakeStore, model: str, tier: str, timeout_s: float) -> str:
        store.num_prefetch_calls += 1
        if tier == "dram" and store.dram_full and model not in store.tiers["dram"]:
            raise TierFullError(f"dram of {store.node_id} is full (injected)")
        store.prefetches.append((model, tier))
        store.tiers[tier].setdefault(model, False)
        return f"/fake/{store.node_id}/{tier}/{model}"

    async def unpin_checkpoint(self, store: FakeStore, model: str, tier: str, timeout_s: float) -> bool:
        store.unpins.append((model, tier))
        if model in store.tiers[tier]:
            store.tiers[tier][model] = False
            return True
        return False

    async def invalidate_checkpoint(self, store: FakeStore, model: str, tier: str, timeout_s: float) -> bool:
        store.invalidations.append((model, tier))
        return store.tiers[tier].pop(model, None) is not None

    async def stop_node_store(self, store: FakeStore, timeout_s: float) -> None:
        store.closed, store.alive = True, False

    # --- workers ----------------------------------------------------------------------------

    def start_worker(self, *, instance_id: str, model_id: str, model_dir: str | None, engine_config: Any,
                     actor_name: str, ray_node_id: str, num_cpus: float, num_gpus: float, peer: Any = None,
                     num_threads: int | None = None) -> Any:
        assert actor_name not in self.workers or not self.workers[actor_name].alive, f"duplicate actor {actor_name}"
        worker = FakeWorker(instance_id, model_id, model_dir, actor_name, ray_node_id, num_cpus, engine_config,
                            peer=peer, weights_resident=peer is None)
        worker.num_threads = num_threads
        self.workers[actor_name] = worker
        self.num_started_workers += 1
        if self.auto_ready:
            worker.finish_loading()
        return worker

    def live_workers(self) -> list[FakeWorker]:
        return sorted((w for w in self.workers.values() if w.alive), key=lambda w: w.instance_id)

    # --- spare workers (never warm unless a test sets `spares_warm`) ----------------------------

    def start_spare_worker(self, *, actor_name: str, ray_node_id: str, host_models: int = 1,
                           num_gpus: int = 0) -> Any:
        spare = FakeWorker("", "", "", actor_name, ray_node_id, 0.0, None, state="spare", num_gpus=num_gpus)
        self.spares[actor_name] = spare
        return spare

    async def spare_warm(self, handle: FakeWorker, timeout_s: float, *, weight_bytes: int = 0, kv_bytes: int = 0
                         ) -> float:
        handle.reserved_bytes = (weight_bytes, kv_bytes)
        await asyncio.wait_for(self.spares_warm.wait(), timeout_s)
        if not handle.alive:
            raise ActorGoneError(f"{handle.actor_name} is dead")
        return 3.0

    async def assign_worker(self, handle: FakeWorker, *, instance_id: str, model_id: str, model_dir: str | None,
                            engine_config: Any, num_threads: int, timeout_s: float, peer: Any = None,
                            step_priority: int = 0) -> None:
        if isinstance(handle, HostedInstance):  # one more model in a slot host: a worker of its own here
            host = handle.host
            if not host.alive:
                raise ActorGoneError(f"{host.actor_name} is dead")
            worker = self.hosted[instance_id] = FakeWorker(
                instance_id, model_id, model_dir or "", host.actor_name, host.ray_node_id, 0.0, engine_config,
                num_threads=num_threads, num_gpus=host.num_gpus, peer=peer, weights_resident=peer is None)
            self.assigned_spares.append(host.actor_name)
            if self.auto_ready:
                worker.finish_loading()
            return
        if not handle.alive:
            raise ActorGoneError(f"{handle.actor_name} is dead")
        assert handle.state == "spare", f"{handle.actor_name} assigned twice"
        handle.instance_id, handle.model_id, handle.model_dir = instance_id, model_id, model_dir
        handle.peer, handle.weights_resident = peer, peer is None
        handle.engine_config, handle.num_threads, handle.state = engine_config, num_threads, "loading"
        del self.spares[handle.actor_name]
        self.workers[handle.actor_name] = handle
        self.assigned_spares.append(handle.actor_name)
        if self.auto_ready:
            handle.finish_loading()

    async def stream_weights(self, handle: FakeWorker, num_receivers: int, config: Any, timeout_s: float) -> Any:
        handle = self._resolve(handle)
        if not handle.alive:
            raise ActorGoneError(f"{handle.actor_name} is dead")
        if handle.stream_error is not None:
            raise handle.stream_error
        self.streams.append((handle.instance_id, num_receivers))
        return FakeTicket(handle.instance_id, num_receivers)

    async def supply_fallback(self, handle: FakeWorker, model_dir: str, timeout_s: float) -> None:
        handle = self._resolve(handle)
        if not handle.alive:
            raise ActorGoneError(f"{handle.actor_name} is dead")
        assert handle.peer is not None and handle.fallback_dir is None, "fallback supplied without a stream, or twice"
        handle.fallback_dir = model_dir

    def _resolve(self, handle: Any) -> FakeWorker:
        """The fake worker behind `handle`: itself, or the hosted instance a `HostedInstance` names."""
        return self.hosted[handle.instance_id] if isinstance(handle, HostedInstance) else handle

    def live_spares(self) -> list[FakeWorker]:
        return sorted((w for w in self.spares.values() if w.alive), key=lambda w: w.actor_name)

    async def find_worker(self, actor_name: str, instance_id: str | None = None) -> Any | None:
        worker = self.workers.get(actor_name)
        return worker if worker is not None and worker.alive else None

    async def worker_ready(self, handle: FakeWorker, timeout_s: float) -> Any:
        handle = self._resolve(handle)
        await asyncio.wait_for(handle.loaded.wait(), timeout_s)
        if not handle.alive:
            raise ActorGoneError(f"{handle.actor_name} died while loading")
        if handle.load_error is not None:
            raise handle.load_error
        return FakeLoad(load_s=0.5)

    async def worker_stats(self, handle: FakeWorker, timeout_s: float) -> Any:
        handle = self._resolve(handle)
        if handle.stats_delay_s:
            await asyncio.sleep(min(handle.stats_delay_s, timeout_s))
            if handle.stats_delay_s > timeout_s:
                raise TimeoutError(f"{handle.actor_name} did not answer")
        if not handle.alive:
            raise ActorGoneError(f"{handle.actor_name} is dead")
        return FakeStats(handle.state, handle.num_ongoing_requests, handle.num_generated_tokens, 0.5,
                         handle.weights_resident, tuple(handle.prefills_at_frontier), handle.num_requests_started,
                         handle.num_running_requests, handle.num_waiting_requests, handle.kv_cache_usage)

    async def stop_worker(self, handle: FakeWorker, timeout_s: float) -> None:
        handle = self._resolve(handle)
        if self.stop_gate is not None:
            await self.stop_gate.wait()
        if handle.alive and handle.state != "spare":
            self.stopped_workers.append(handle.instance_id)
        handle.alive, handle.state = False, "stopped"
        handle.loaded.set()

    async def sleep_worker(self, handle: FakeWorker, timeout_s: float) -> int:
        """The worker frees its KV pool and keeps its weights (the real one: `InstanceWorker.sleep`)."""
        handle = self._resolve(handle)
        if not handle.alive:
            raise ActorGoneError(f"{handle.actor_name} is dead")
        if handle.instance_id in self.refuse_sleep or handle.num_ongoing_requests or handle.state != "ready":
            raise RuntimeError(f"instance {handle.instance_id} is {handle.state} with "
                               f"{handle.num_ongoing_requests} open request(s); it cannot sleep")
        self.slept_workers.append(handle.instance_id)
        handle.state = "asleep"
        return 1000

    async def wake_worker(self, handle: FakeWorker, timeout_s: float) -> None:
        handle = self._resolve(handle)
        if not handle.alive:
            raise ActorGoneError(f"{handle.actor_name} is dead")
        self.woken_workers.append(handle.instance_id)
        handle.state = "ready"

    async def release_worker(self, handle: FakeWorker, timeout_s: float) -> None:
        """The worker lets its model go and is a spare again (the real one shuts its engine down)."""
        handle = self._resolve(handle)
        if self.stop_gate is not None:
            await self.stop_gate.wait()
        if not handle.alive:
            raise ActorGoneError(f"{handle.actor_name} is dead")
        self.released_workers.append(handle.instance_id)
        handle.state, handle.request_ids[:], handle.num_ongoing_requests = "spare", [], 0
        handle.loaded = asyncio.Event()
        self.workers.pop(handle.actor_name, None)
        self.spares[handle.actor_name] = handle

    async def worker_request_ids(self, handle: FakeWorker, timeout_s: float) -> list[str]:
        handle = self._resolve(handle)
        if not handle.alive:
            raise ActorGoneError(f"{handle.actor_name} is dead")
        return list(handle.request_ids)

    async def park_requests(self, handle: FakeWorker, instance_id: str, max_bytes: int,
                            timeout_s: float) -> dict[str, Any]:
        """Parks each open request whose KV (`kv_bytes`, default 1000 each) fits the budget, in order."""
        handle = self._resolve(handle)
        if not handle.alive:
            raise ActorGoneError(f"{handle.actor_name} is dead")
        parked, used = {}, 0
        for request_id in list(handle.request_ids):
            size = self.kv_bytes.get(request_id, 1000)
            if used + size > max_bytes:
                continue
            used += size
            parked[request_id] = FakeParked(request_id, size)
            handle.request_ids.remove(request_id)
        handle.num_ongoing_requests = len(handle.request_ids)
        self.parkings.append((instance_id, sorted(parked)))
        return parked

    async def unpark_requests(self, handle: FakeWorker, instance_id: str, parked: list[Any],
                              timeout_s: float) -> list[str]:
        handle = self._resolve(handle)
        if not handle.alive:
            raise ActorGoneError(f"{handle.actor_name} is dead")
        replayed = [p.request_id for p in parked if p.request_id not in self.refuse_replay]
        handle.request_ids.extend(replayed)
        self.replays.append((instance_id, replayed))
        return replayed

    async def suspend_requests(self, handle: FakeWorker, timeout_s: float) -> list[str]:
        """Ends the worker's open requests "suspended": they leave it (the gateway re-queues them)."""
        handle = self._resolve(handle)
        if not handle.alive:
            raise ActorGoneError(f"{handle.actor_name} is dead")
        suspended, handle.request_ids[:] = list(handle.request_ids), []
        handle.num_ongoing_requests = 0
        self.suspensions.append((handle.instance_id, suspended))
        return suspended

    async def migrate_requests(self, source: FakeWorker, source_instance_id: str, dest: FakeWorker,
                               dest_instance_id: str, request_ids: list[str], method: str,
                               timeout_s: float) -> list[Any]:
        """Moves each request still open on the source (the others "finished"), as the real one."""
        from migration import MigrationMethod, MigrationOutcome, MigrationStatus

        self.migrations.append((source_instance_id, dest_instance_id, list(request_ids), method))
        outcomes = []
        for request_id in request_ids:
            moved = request_id in source.request_ids and dest.alive
            if moved:
                source.request_ids.remove(request_id)
                dest.request_ids.append(request_id)
                source.prefills_at_frontier = tuple(r for r in source.prefills_at_frontier if r != request_id)
            source.num_ongoing_requests, dest.num_ongoing_requests = len(source.request_ids), len(dest.request_ids)
            status = MigrationStatus.MIGRATED if moved else MigrationStatus.FINISHED
            outcomes.append(MigrationOutcome(request_id, MigrationMethod(method), status, source_instance_id,
                                             dest_instance_id, 1, 0, 0, 0, 0, 0.0, 0.0))
        return outcomes

    async def list_worker_actor_names(self) -> list[str]:
        return sorted(name for name, worker in (self.workers | self.spares).items() if worker.alive)

    async def kill_worker(self, actor_name: str) -> None:
        if actor_name in self.spares:
            self.spares[actor_name].alive = False
            self.killed_spares.append(actor_name)
            return
        worker = self.workers[actor_name]
        worker.alive = False
        worker.loaded.set()
        self.killed_workers.append(actor_name)

    def add_orphan(self, actor_name: str, model_id: str) -> FakeWorker:
        """A worker actor no record accounts for (left by something else in the namespace)."""
        worker = FakeWorker(actor_name, model_id, "/nowhere", actor_name, self.ray_nodes[0].ray_node_id, 1.0, None)
        worker.finish_loading()
        self.workers[actor_name] = worker
        return worker
