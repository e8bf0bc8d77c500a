"""The model instances the controller runs: starting, stopping, adopting, and their records.

The controller decides *how many* instances a model has and *where* a new one goes; this class
makes it so, one instance at a time, without ever blocking a reconcile tick:

- `start`: the instance takes its slot at once (LOADING) and its worker record is written
  before its actor exists (or, when a warm spare worker on the node serves it, before the spare
  is given the model) -- a crash from there on leaves a record to clean up, never an actor
  nobody knows. The tier the checkpoint is read from is decided once, here, from the placement
  decision's (`placement_policy.pin_tier`: the DRAM copy when placement chose DRAM, else the SSD,
  where a repository fetch lands); nothing later chooses again. A task then asks the node's store
  to bring the checkpoint into that tier if it is not there and pin it (the SSD instead only when
  a full DRAM refuses it), assigns the model to the spare or starts a worker actor on that node
  with the store's local path, and awaits ``ready()``: READY, recorded, routed. A
  failed start is stopped, forgotten, and the model backs off before its next start. When a
  running instance of the model would deliver the weights sooner than the node's tier
  (`controller.stream_source_policy`), the new worker takes them from that instance's stream
  instead and is READY as soon as its engine exists (it computes with the layers it has); the
  checkpoint is pinned on its node meanwhile and handed over as the stream's fallback
  (`controller.weight_sources`). A stream (or a peer's refusal) is an event ("load_path"); every
  instance's path and its reason are part of it in ``thaw status``.
- `begin_stop`: out of the routing table at once; the instance finishes its open requests (up
  to a drain timeout), then shuts down, and its record goes. A request still open at the
  shutdown (past the timeout, or routed there as the stop began) ends "suspended", and the
  gateway continues it on the model's next instance.
- `begin_sleep` / `begin_wake`: where memory is the slot, a model scaling down puts an idle
  instance to sleep instead of stopping it (out of routing at once, its worker's KV pool freed,
  its weights kept: ASLEEP, holding its weights' memory and no slot; on a GPU, its weights in
  pinned host memory: none of the GPU's, and its place kept), and its next demand wakes
  it (LOADING until the pool is rebuilt, then READY) in a fraction of a load. A worker that
  cannot sleep (a request raced the decision) is stopped as it was before sleep existed (its
  requests drained first); one that cannot wake is stopped like a failed start. Sleepers are what eviction takes first (`eviction_policy`).
- `adopt`: after a restart, the records whose actors are alive become instances again (READY
  or still LOADING), the others are forgotten, and a worker actor of the namespace that no
  record accounts for is ended -- so nothing is ever started twice.

A loaded instance is awaited by `before_ready(instance)` (when given) before it is routed: the
controller replays the model's parked requests into it there, so their clients find them running.

Every change that affects routing calls `on_routes_changed(model_id)`, a freed slot calls
`context.wake()` (a model waiting for room need not wait for the next tick), and every
lifecycle event goes to `context.record` (the controller's recent decisions) and the log.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from typing import Any

from controller.control_context import ControlContext
from controller.cluster_client import ActorGoneError, ClusterClient, worker_actor_name
from controller.cluster_node import ClusterNode, has_worker_memory_budget, store_tier
from controller.controller_config import ControllerConfig
from controller.controller_status import event_to_dict
from controller.engine_settings import engine_config_for
from controller.managed_instance import ManagedInstance
from controller.model_source import repository_name
from controller.model_spec import ModelSpec
from controller.model_state import ModelState
from controller.placement_policy import pin_tier
from controller.spare_pool import SparePool
from controller.state_store import StateStore, WorkerRecord
from controller.weight_sources import WeightSources
from wire import EngineGauges, HostedInstance, InstanceState, is_hosted

logger = logging.getLogger(__name__)
DRAIN_POLL_S = 0.1
WORKER_SHUTDOWN_TIMEOUT_S = 10.0


class InstanceManager:
    """See the module docstring. `models` is the controller's registry, read (never changed) here
    but for the start back-off and the last-request time."""

    def __init__(self, config: ControllerConfig, cluster: ClusterClient, store: StateStore,
                 models: Mapping[str, ModelState], *, on_routes_changed: Callable[[str], None],
                 context: ControlContext, spares: SparePool | None = None,
                 before_ready: Callable[[ManagedInstance], Awaitable[None]] | None = None) -> None:
        self.config = config
        self._cluster = cluster
        self._store = store
        self._models = models
        self._on_routes_changed = on_routes_changed
        self._on_slot_freed = context.wake
        self._record = context.record
        self._clock = context.clock
        self._wall_clock = context.wall_clock
        self._spares = spares
        self._before_ready = before_ready
        self._instances: dict[str, ManagedInstance] = {}
        self._tasks: set[asyncio.Task] = set()
        self._stop_tasks: dict[str, asyncio.Task] = {}
        self._sleep_tasks: dict[str, asyncio.Task] = {}
        # "sleeps", "wakes", and "fresh_workers" (instances that started a process, no spare warm) so far
        self.counts: collections.Counter[str] = collections.Counter()
        self._weights = WeightSources(config, cluster, self.get, self._event)

    # --- queries -----------------------------------------------------------------------------

    def all(self) -> list[ManagedInstance]:
        return sorted(self._instances.values(), key=lambda i: i.instance_id)

    def engine_gauges(self) -> list[EngineGauges]:
        """Every ready instance's engine load as its worker last reported it, by instance id."""
        return [EngineGauges(i.instance_id, i.model_id, i.node_id, i.num_running_requests, i.num_waiting_requests,
                             i.kv_cache_usage) for i in self.all() if i.phase is InstanceState.READY]

    def get(self, instance_id: str) -> ManagedInstance | None:
        return self._instances.get(instance_id)

    def of_model(self, model_id: str) -> list[ManagedInstance]:
        return [i for i in self.all() if i.model_id == model_id]

    def live(self, model_id: str) -> list[ManagedInstance]:
        """The model's instances that count as its instances: loading or ready."""
        return [i for i in self.of_model(model_id) if i.serving]

    def ready_routes(self, model_id: str) -> list[ManagedInstance]:
        return [i for i in self.of_model(model_id) if i.phase is InstanceState.READY]

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _worker_record(self, instance: ManagedInstance) -> WorkerRecord:
        return WorkerRecord(instance_id=instance.instance_id, model_id=instance.model_id, node_id=instance.node_id,
                            actor_name=instance.actor_name, state=instance.phase)

    def _event(self, kind: str, instance: ManagedInstance, reason: str) -> None:
        self._record(event_to_dict(kind, instance.model_id, reason, self._wall_clock(), instance.instance_id))

    # --- starting ----------------------------------------------------------------------------

    def start(self, model: ModelState, node: ClusterNode, estimate_s: float | None, now: float, *,
              tier: str | None = None, draining_node_ids: Collection[str] = (), memory_bytes: int = 0,
              kv_memory_bytes: int = 0) -> ManagedInstance:
        """Take a slot on `node` for a new instance of `model` and start it in the background.
        `tier`: where placement estimated it loads from in `estimate_s` -- the checkpoint is pinned
        in the node-store tier that implies (`pin_tier`; without one, the DRAM copy if the node's
        last report has it, else SSD); with `config.peer_stream`, a running instance's stream is
        taken instead when it is estimated faster (`choose_load_path`), and that pin is its fallback.
        `memory_bytes`: what it takes of the node's worker memory budget until it is gone
        (`kv_memory_bytes` of it its KV pool's, which sleeping frees)."""
        instance_id = f"{model.repository_name}-{uuid.uuid4().hex[:8]}"
        spare, handle = None, None
        hosts_here = self._spares is not None and self._spares.hosting and has_worker_memory_budget(node, self.config)
        if hosts_here and model.spec.resources.num_gpus <= (1 if node.num_gpus else 0):
            spare = self._spares.host_for(node.ray_node_id, instance_id, memory_bytes,  # one more model in a host
                                          **self._host_room(node))
            handle = HostedInstance(spare.handle, instance_id) if spare is not None else None
        elif self._spares is not None and model.spec.resources.num_gpus == 0:
            spare = self._spares.take(node.ray_node_id)
            handle = spare.handle if spare is not None else None
        instance = ManagedInstance(
            instance_id=instance_id, model_id=model.model_id, node_id=node.node_id, ray_node_id=node.ray_node_id,
            actor_name=spare.actor_name if spare is not None else worker_actor_name(instance_id),
            num_worker_slots=model.spec.resources.num_worker_slots, repository_name=model.repository_name,
            estimate_s=estimate_s, started_s=now, handle=handle, from_spare=spare is not None,
            hosted=is_hosted(handle), reserves_cpus=spare is None, memory_bytes=memory_bytes,
            kv_memory_bytes=kv_memory_bytes, sleeps_to_host=node.num_gpus > 0)
        if tier is not None and estimate_s is not None:
            self._weights.choose_path(instance, model, tier, estimate_s, self.all(), draining_node_ids)
        self._store.put_worker(self._worker_record(instance))  # before the actor: see the module docstring
        self._instances[instance_id] = instance
        self.counts["fresh_workers"] += int(spare is None)
        checkpoint_tier = pin_tier(tier) if tier is not None else store_tier(node.report, model.repository_name,
                                                                               self.config)
        self._spawn(self._start(instance, model, node, checkpoint_tier))
        return instance

    def _host_room(self, node: ClusterNode) -> dict[str, Any]:
        """`SparePool.can_host`'s memory arguments for `node`: on a GPU node each host has its GPU's
        memory (`ControllerConfig.gpu_memory_bytes`) for the instances it holds; on a CPU node the
        node's budget is shared by all its processes, and placement has checked it already."""
        if not node.num_gpus:
            return {}
        return {"capacity_bytes": self.config.gpu_memory_bytes,
                "held_bytes": {i.instance_id: i.held_memory_bytes for i in self._instances.values()}}

    def gpu_host_refusal(self, model: ModelState, node: ClusterNode, memory_bytes: int) -> str | None:
        """Why `model` cannot start on GPU node `node` now although placement chose it, None if it
        can (or `node` shares no GPU by memory). Such a node's slot hosts own its GPUs, so an
        instance starts only in a warm host whose GPU has the memory for it, never in a fresh process."""
        if self._spares is None or not node.num_gpus or not has_worker_memory_budget(node, self.config):
            return None
        num_gpus = model.spec.resources.num_gpus
        if num_gpus > 1:
            return (f"{model.model_id} asks for {num_gpus:g} GPUs per instance (resources.num_gpus), and node "
                    f"{node.node_id} shares each GPU among the models of its slot host (gpu_memory_bytes): "
                    f"a model there runs on one GPU; deploy it with num_gpus 1")
        if self._spares.can_host(node.ray_node_id, memory_bytes, **self._host_room(node)) is None:
            return (f"no warm slot host on node {node.node_id} has a place and {memory_bytes / 2**30:.3g} GiB of "
                    f"its GPU's memory free for {model.model_id} (hosts still starting, or each GPU's models "
                    f"leave too little); it waits for one")
        return None

    def _engine_config(self, spec: ModelSpec) -> Any:
        return engine_config_for(spec, self.config)

    async def _start(self, instance: ManagedInstance, model: ModelState, node: ClusterNode,
                     checkpoint_tier: str) -> None:
        try:
            peer, path = await self._weights.open_stream(instance), None
            if peer is None:
                path, instance.tier = await self._weights.pin_checkpoint(node, model.repository_name, checkpoint_tier)
            if instance.phase is not InstanceState.LOADING:
                return  # stopped while the checkpoint arrived: no actor to start
            spec = model.spec
            instance.weights_resident = peer is None
            if instance.from_spare:
                await self._cluster.assign_worker(
                    instance.handle, instance_id=instance.instance_id, model_id=instance.model_id, model_dir=path,
                    engine_config=self._engine_config(spec), num_threads=max(1, int(spec.resources.num_cpus)),
                    timeout_s=self.config.report_timeout_s, peer=peer, step_priority=spec.autoscaling.priority)
            else:
                # Sharing a CPU node by memory, an instance reserves no Ray CPU (as a spare does):
                # slots and the memory budget bound the node, idle instances cost no CPU, and a
                # CPU reservation would keep a node's co-resident models to its core count.
                shares = has_worker_memory_budget(node, self.config) and spec.resources.num_gpus == 0
                instance.reserves_cpus = not shares
                instance.handle = self._cluster.start_worker(
                    instance_id=instance.instance_id, model_id=instance.model_id, model_dir=path,
                    engine_config=self._engine_config(spec), actor_name=instance.actor_name,
                    ray_node_id=instance.ray_node_id, num_cpus=0 if shares else spec.resources.num_cpus,
                    num_gpus=spec.resources.num_gpus, peer=peer,
                    num_threads=max(1, int(spec.resources.num_cpus)) if shares else None)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the instance is discarded and retried
            if instance.phase is InstanceState.LOADING:
                await self._start_failed(instance, exc)
            return
        if peer is not None:
            self._spawn(self._weights.supply_fallback(instance, model, node, checkpoint_tier))
        await self._await_ready(instance)

    async def _await_ready(self, instance: ManagedInstance) -> None:
        try:
            load = await self._cluster.worker_ready(instance.handle, self.config.load_timeout_s)
        except Exception as exc:  # noqa: BLE001
            if instance.phase is InstanceState.LOADING:
                await self._start_failed(instance, exc)
            return
        if instance.phase is not InstanceState.LOADING:
            return  # stopped while it loaded
        instance.load_s = load.load_s
        instance.pack_s = load.weights_pack_s
        estimate = f"{instance.estimate_s:.3g}s" if instance.estimate_s is not None else "unknown"
        path = instance.load_path
        source = (f"a stream from {path.source_instance_id}, layers still arriving" if path is not None
                  and path.kind == "stream" else instance.tier or "an unknown tier")
        await self._enter_ready(instance, "ready",
                                f"ready on {instance.node_id} from {source} in {load.load_s:.3g}s (estimated {estimate})")

    async def _enter_ready(self, instance: ManagedInstance, kind: str, reason: str) -> None:
        """A loaded (or woken) instance: prepared by `before_ready`, then READY, recorded, routed."""
        if self._before_ready is not None:
            try:
                await self._before_ready(instance)  # e.g. the model's parked requests replayed into it
            except Exception:  # noqa: BLE001 - it serves all the same
                logger.exception("preparing %s before routing it failed", instance.instance_id)
            if instance.phase is not InstanceState.LOADING:
                return
        instance.phase = InstanceState.READY
        instance.ready_s = self._clock()
        self._store.put_worker(self._worker_record(instance))
        model = self._models.get(instance.model_id)
        if model is not None:
            model.start_succeeded()
        self._on_routes_changed(instance.model_id)
        logger.info("%s: instance %s %s", instance.model_id, instance.instance_id, reason)
        self._event(kind, instance, reason)

    async def _start_failed(self, instance: ManagedInstance, exc: BaseException) -> None:
        instance.last_error = f"{type(exc).__name__}: {exc}"
        model = self._models.get(instance.model_id)
        delay_s = model.start_failed(self._clock(), self.config.start_retry_delay_s) if model is not None else 0.0
        reason = f"start failed: {instance.last_error}; next start in {delay_s:g}s"
        logger.warning("%s: instance %s %s", instance.model_id, instance.instance_id, reason)
        self._event("start_failed", instance, reason)
        await self.begin_stop(instance, "start failed", 0.0)

    # --- reports -----------------------------------------------------------------------------

    def apply_stats(self, instance: ManagedInstance, stats: Any, now: float) -> None:
        """Take in a ready worker's report; a worker that reports FAILED or STOPPED is replaced."""
        if stats.state in (InstanceState.FAILED, InstanceState.STOPPED):
            self.begin_stop(instance, f"worker reports {InstanceState(stats.state).value}", 0.0)
            return
        model = self._models.get(instance.model_id)
        if model is not None and (stats.num_ongoing_requests > 0
                                  or stats.num_generated_tokens != instance.num_generated_tokens):
            model.last_request_s = now  # requests that came and went between ticks count too
        started = getattr(stats, "num_requests_started", 0)
        if model is not None and started > instance.num_requests_started:
            model.usage.add(started - instance.num_requests_started, now)  # the eviction policy's frequency
        instance.num_requests_started = started
        instance.pid = getattr(stats, "pid", 0)
        instance.num_ongoing_requests = stats.num_ongoing_requests
        instance.num_generated_tokens = stats.num_generated_tokens
        instance.num_running_requests = getattr(stats, "num_running_requests", 0)
        instance.num_waiting_requests = getattr(stats, "num_waiting_requests", 0)
        instance.kv_cache_usage = min(1.0, max(0.0, float(getattr(stats, "kv_cache_usage", 0.0))))
        resident = getattr(stats, "weights_resident", True)
        if resident and not instance.weights_resident:
            logger.info("%s: instance %s has every layer: %s", instance.model_id, instance.instance_id,
                        getattr(stats, "weights_read", ""))
        instance.weights_resident = resident
        instance.prefills_at_frontier = tuple(getattr(stats, "prefills_at_frontier", ()))

    def died(self, instance: ManagedInstance, why: str) -> None:
        """The worker's actor is gone: forget it (its slot is free; the autoscaler replaces it). A
        hosted instance's host is dropped from the pool too when its actor died (rather than the
        host having unloaded the instance)."""
        logger.warning("%s: instance %s died: %s", instance.model_id, instance.instance_id, why)
        if instance.hosted and self._spares is not None and "is not held by this slot host" not in why:
            self._spares.drop_host(instance.actor_name)
        self._event("died", instance, why)
        self._forget(instance)

    # --- sleep and wake ----------------------------------------------------------------------

    def asleep(self, model_id: str) -> list[ManagedInstance]:
        """The model's sleeping instances, the one asleep the shortest first."""
        return sorted((i for i in self.of_model(model_id) if i.phase is InstanceState.ASLEEP),
                      key=lambda i: (-(i.asleep_s or 0.0), i.instance_id))

    def _put_record(self, instance: ManagedInstance) -> None:
        try:
            self._store.put_worker(self._worker_record(instance))
        except Exception:  # noqa: BLE001 - the record is advisory (see adopt); the change matters more
            logger.exception("recording %s as %s failed", instance.instance_id, instance.phase.value)

    def begin_sleep(self, instance: ManagedInstance, reason: str) -> None:
        """Out of routing now (ASLEEP: its slot and KV share free for placement); its worker frees
        its KV pool once its open requests are done, in the background."""
        instance.phase, instance.asleep_s = InstanceState.ASLEEP, self._clock()
        self._put_record(instance)
        self._on_routes_changed(instance.model_id)
        self.counts["sleeps"] += 1
        logger.info("%s: %s goes to sleep: %s", instance.model_id, instance.instance_id, reason)
        self._event("sleep", instance, reason)
        task = self._spawn(self._sleep(instance))
        self._sleep_tasks[instance.instance_id] = task
        task.add_done_callback(lambda _: self._sleep_tasks.pop(instance.instance_id, None))

    async def _sleep(self, instance: ManagedInstance) -> None:
        try:
            await self._drain(instance, self.config.drain_timeout_s)
            freed = await self._cluster.sleep_worker(instance.handle, WORKER_SHUTDOWN_TIMEOUT_S)
        except ActorGoneError as exc:
            if instance.phase is InstanceState.ASLEEP:
                self.died(instance, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - it did not sleep: it is stopped as before sleep existed
            if instance.phase is InstanceState.ASLEEP:
                why = f"could not sleep ({type(exc).__name__}: {exc}); stopping it instead"
                logger.warning("%s: %s %s", instance.model_id, instance.instance_id, why)
                self._event("sleep_failed", instance, why)
                instance.phase, instance.asleep_s = InstanceState.READY, None  # so its requests drain first
                self.begin_stop(instance, why, self.config.drain_timeout_s, recycle=True)
            return
        logger.info("%s: %s asleep (%.3g MB of KV pool freed)", instance.model_id, instance.instance_id, freed / 1e6)
        self._on_slot_freed()

    def begin_wake(self, instance: ManagedInstance, reason: str) -> None:
        """LOADING again now (it counts as its model's instance); its worker rebuilds the KV pool
        (after the sleep, if that is still under way), then it is READY and routed."""
        now = self._clock()
        instance.phase, instance.asleep_s = InstanceState.LOADING, None
        instance.started_s, instance.ready_s, instance.estimate_s = now, None, 0.0
        self._put_record(instance)
        self.counts["wakes"] += 1
        logger.info("%s: waking %s: %s", instance.model_id, instance.instance_id, reason)
        self._event("wake", instance, reason)
        self._spawn(self._wake(instance))

    async def _wake(self, instance: ManagedInstance) -> None:
        pending = self._sleep_tasks.get(instance.instance_id)
        if pending is not None:
            await asyncio.wait([pending])
        started = self._clock()
        try:
            await self._cluster.wake_worker(instance.handle, WORKER_SHUTDOWN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a worker that cannot wake is replaced like a failed start
            if instance.phase is InstanceState.LOADING:
                await self._start_failed(instance, exc)
            return
        if instance.phase is InstanceState.LOADING:
            await self._enter_ready(instance, "woke",
                                    f"awake on {instance.node_id} in {self._clock() - started:.3g}s (no load)")

    # --- stopping ----------------------------------------------------------------------------

    def begin_stop(self, instance: ManagedInstance, reason: str, drain_timeout_s: float, *,
                   recycle: bool = False) -> asyncio.Task:
        """Take the instance out of routing now; drain and stop it in the background. With
        `recycle` (its slot goes to another model, or the model scaled down), a worker whose process
        reserves no Ray CPU (`ManagedInstance.reusable_process`) goes back to the spare pool, model
        let go, when the node's pool has room: the next start skips a process."""
        running = self._stop_tasks.get(instance.instance_id)
        if running is not None:
            return running
        was_ready = instance.phase is InstanceState.READY
        instance.phase = InstanceState.STOPPING
        try:
            self._store.put_worker(self._worker_record(instance))
        except Exception:  # noqa: BLE001 - the record is advisory; stopping matters more
            logger.exception("recording the stop of %s failed", instance.instance_id)
        self._on_routes_changed(instance.model_id)
        logger.info("%s: stopping %s: %s", instance.model_id, instance.instance_id, reason)
        self._event("stop", instance, reason)
        task = self._spawn(self._stop(instance, drain_timeout_s if was_ready else 0.0, recycle))
        self._stop_tasks[instance.instance_id] = task
        task.add_done_callback(lambda _: self._stop_tasks.pop(instance.instance_id, None))
        return task

    async def _stop(self, instance: ManagedInstance, drain_timeout_s: float, recycle: bool = False) -> None:
        try:
            if instance.handle is not None:
                try:
                    await self._drain(instance, drain_timeout_s)
                except Exception:  # noqa: BLE001 - a worker that cannot report is stopped anyway
                    logger.exception("draining %s failed; stopping it now", instance.instance_id)
                if not (recycle and await self._recycle(instance)):
                    await self._cluster.stop_worker(instance.handle, WORKER_SHUTDOWN_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - stop_worker ends the actor whatever happened before
            logger.exception("stopping %s failed", instance.instance_id)
        finally:
            self._forget(instance)
        logger.info("%s: instance %s stopped", instance.model_id, instance.instance_id)

    async def _recycle(self, instance: ManagedInstance) -> bool:
        """The worker back into the spare pool, its model let go; False: it is to be stopped
        (its process holds Ray CPUs a spare does not, no room, or it failed; or it is hosted, and
        stopping it unloads it from its host, which stays in the pool)."""
        if self._spares is None or instance.hosted or not instance.reusable_process \
                or not self._spares.has_room(instance.ray_node_id):
            return False
        try:
            await self._cluster.release_worker(instance.handle, WORKER_SHUTDOWN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - then it is stopped like any other
            logger.warning("%s: letting %s's model go failed (%s: %s); stopping it", instance.model_id,
                           instance.instance_id, type(exc).__name__, exc)
            return False
        if not self._spares.adopt(instance.actor_name, instance.ray_node_id, instance.handle):
            return False
        self._event("recycled", instance, "its worker process is a spare again")
        return True

    async def _drain(self, instance: ManagedInstance, timeout_s: float) -> None:
        """Wait until the instance has no open request, or `timeout_s` (real time) has passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            try:
                stats = await self._cluster.worker_stats(instance.handle, self.config.report_timeout_s)
            except ActorGoneError:
                return
            except TimeoutError:
                continue
            if stats.num_ongoing_requests == 0:
                return
            await asyncio.sleep(DRAIN_POLL_S)

    def _forget(self, instance: ManagedInstance) -> None:
        if instance.hosted and self._spares is not None:
            self._spares.unhost(instance.actor_name, instance.instance_id)
        if self._instances.get(instance.instance_id) is instance:
            del self._instances[instance.instance_id]
            try:
                self._store.delete_worker(instance.instance_id)
            except Exception:  # noqa: BLE001 - a stale record is cleaned up at the next start
                logger.exception("deleting the record of %s failed", instance.instance_id)
            self._on_slot_freed()
        self._on_routes_changed(instance.model_id)

    async def close(self, stop_workers: bool) -> None:
        """Stop every instance (or leave them running for a successor) and end all tasks."""
        if stop_workers:
            stops = [self.begin_stop(instance, "controller shutdown", 0.0) for instance in self.all()]
            await asyncio.gather(*stops, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- adoption ----------------------------------------------------------------------------

    async def adopt(self, nodes: Mapping[str, ClusterNode]) -> None:
        """Take over the workers of the records whose actors are alive, forget the rest, and end
        any worker actor of the namespace that no record accounts for."""
        records = self._store.list_workers()
        probes = await asyncio.gather(*(self._probe(record) for record in records))  # all at once: a
        now = self._clock()  # restart with many workers must not take one timeout per worker
        for record, (handle, stats) in zip(records, probes):
            if handle is None:
                logger.info("worker %s of %s is gone; forgetting it", record.instance_id, record.model_id)
                self._store.delete_worker(record.instance_id)
                continue
            self._adopt_one(record, handle, stats, nodes.get(record.node_id), now)
        known = {instance.actor_name for instance in self._instances.values()}
        for name in await self._cluster.list_worker_actor_names():
            if name not in known:
                logger.warning("worker actor %s has no record; ending it", name)
                await self._cluster.kill_worker(name)

    async def _probe(self, record: WorkerRecord) -> tuple[Any, Any]:
        """(handle, stats) of a recorded worker: (None, None) if its actor is gone, stats None
        if it is alive but did not answer in time (adopted anyway; the next tick tells)."""
        handle = await self._cluster.find_worker(record.actor_name, record.instance_id)
        if handle is None:
            return None, None
        try:
            return handle, await self._cluster.worker_stats(handle, self.config.report_timeout_s)
        except ActorGoneError:
            return None, None
        except TimeoutError:
            return handle, None

    def price_adopted(self, price: Callable[[ModelState], tuple[int, int] | None]) -> None:
        """Gives every instance still without a worker memory share (adopted after a restart, before
        its model's size was known) the one `price` names for its model: (its whole share, its KV
        pool's part of it), None while not known. The KV part matters for an adopted sleeper: it
        holds its weights alone, and wakes only where its KV pool fits again."""
        for instance in self._instances.values():
            model = self._models.get(instance.model_id)
            if instance.memory_bytes == 0 and model is not None:
                instance.memory_bytes, instance.kv_memory_bytes = price(model) or (0, 0)

    def _adopt_one(self, record: WorkerRecord, handle: Any, stats: Any, node: ClusterNode | None,
                   now: float) -> None:
        model = self._models.get(record.model_id)
        instance = ManagedInstance(
            instance_id=record.instance_id, model_id=record.model_id, node_id=record.node_id,
            ray_node_id=node.ray_node_id if node is not None else "", actor_name=record.actor_name,
            num_worker_slots=model.spec.resources.num_worker_slots if model is not None else 1,
            repository_name=model.repository_name if model is not None else repository_name(record.model_id),
            handle=handle, started_s=now, hosted=is_hosted(handle), reserves_cpus=not is_hosted(handle),
            sleeps_to_host=node is not None and node.num_gpus > 0)  # a GPU engine sleeps in host memory
        self._instances[instance.instance_id] = instance
        if instance.hosted and self._spares is not None and node is not None:
            self._spares.adopt_host(record.actor_name, node.ray_node_id, handle.host, record.instance_id)
        state = stats.state if stats is not None else None
        if model is None or record.state is InstanceState.STOPPING or state in (InstanceState.FAILED,
                                                                                InstanceState.STOPPED):
            why = "its model was deleted" if model is None else f"it was {InstanceState(state or record.state).value}"
            self.begin_stop(instance, f"adopted, but {why}", 0.0)
            return
        if state == InstanceState.ASLEEP or (state is None and record.state is InstanceState.ASLEEP):
            instance.phase, instance.asleep_s = InstanceState.ASLEEP, now
            if record.state is not InstanceState.ASLEEP:
                self._store.put_worker(self._worker_record(instance))
        elif state == InstanceState.READY or (state is None and record.state is InstanceState.READY):
            instance.phase, instance.ready_s = InstanceState.READY, now
            if stats is not None:
                instance.num_ongoing_requests = stats.num_ongoing_requests
                instance.num_generated_tokens = stats.num_generated_tokens
                instance.load_s = stats.load_s
                instance.pid = getattr(stats, "pid", 0)
            if record.state is not InstanceState.READY:
                self._store.put_worker(self._worker_record(instance))
            self._on_routes_changed(instance.model_id)
        else:
            self._spawn(self._await_ready(instance))
        logger.info("adopted %s of %s (%s) on %s", instance.instance_id, instance.model_id, instance.phase.value,
                    instance.node_id)
        self._event("adopted", instance, f"{instance.phase.value} on {instance.node_id}")
