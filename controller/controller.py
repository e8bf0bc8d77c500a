"""The controller: the model registry, and the reconcile loop that gives each model its instances.

A plain class on one asyncio event loop (the Ray actor in `controller_actor.py` only forwards to
it); every cluster call goes through a `ClusterClient`, so all of this is unit-tested with a
fake cluster and a fake clock. After Ray Serve's controller: a tick gathers live reports, runs
the policies, acts, and a failure in one step is logged without stopping the others or the loop.

One tick (`reconcile_once`):

1. nodes (`NodeRoster.refresh`): the live Ray nodes give the logical nodes; each gets its node
   store (found by name, else started);
2. reports (`NodeRoster.gather_reports`), gathered in parallel with a timeout each: every store's
   holdings and rates, every ready worker's stats (a dead or FAILED worker is dropped and
   replaced; the live report always wins). Prompts waiting on a streamed instance's missing
   layers go to loaded ones (`PrefillHelper`). Where memory is the slot, instances adopted after
   a restart get their share of their node's budget once their model's size is read;
3. autoscale, per model: `decide` on ongoing requests (summed over its workers) plus the
   requests the gateways report queued, against the model's desired count; the new count is
   saved, then the instances are converged to it: missing ones placed (`InstancePlacer`: `place`
   over a `NodeView` per node, slot sharing when none has room) and started, extra ones stopped, idle and loading ones first;
4. pins and promotion (`CheckpointCopies`): a node store keeps pinned exactly the checkpoints its
   running instances came from, and a settled node copies into DRAM what was loaded from SSD;
5. spares: each node's pool of model-less workers is refilled once the node has settled.

Live migration (`migrate`, a drain moving requests off) is driven by `RequestMover`; when a cold
model would be ready soonest on a full node, `SlotReclaimer` empties an instance there by
migration and holds the slot for it (placement step 3). Slots are shared on demand
(`SlotSharer`): models with waiting requests are placed first, those that can still meet their
first-token deadline first, and when no slot is free one is taken from an idle instance
(eviction), or, to save a deadline or past a lower priority's bounded wait, from a busy one (preemption: its requests migrate or are suspended until their model's next
slot). `notify_demand` answers the gateway with the model's `SlotOutlook`.

Starting and stopping are asynchronous (`InstanceManager`), so a tick never waits on a load: an
instance takes its slot at once (LOADING) and is routed when ``ready()`` answers; a stopping one
leaves the routing table at once and finishes its open requests first.

Tenants' quotas (`TenantQuota`, set with `set_tenant_quota`) bound what a tenant may hold: a
tenant with ``max_instances`` instances loading or ready gets no placement for any of its models
(the refusal is the model's placement reason) until one stops; ``max_queued_requests`` is the
gateways' to enforce, from `tenant_quotas`.

The registry (deploy, update, delete, scale, tenants' quotas) is `ModelRegistry`'s; the controller
forwards to it (a deploy started with `start_deploy` runs as a background job, `DeployJobs`, whose
progress `deploy_progress` reads) and gives it what a change means for the cluster (stopping a deleted model's
instances, dropping stale node copies). What the gateway reads of the models is `model_records`
(`wire.ModelRecord`: queue limits, the deploy time, how each instance was loaded).

Durable state (specs, tenants, quotas, desired counts, a record per worker) is in the state store; the
worker record is written before its actor exists, so a crash can leave a record without an
actor (cleaned up at the next start) but never an actor nobody knows. A new controller on the
same state adopts the workers still alive, by name, and starts nothing twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from controller.autoscale_policy import AutoscaleState
from controller.cluster_client import ClusterClient
from controller.checkpoint_copies import CheckpointCopies
from controller.cluster_node import ClusterNode, has_worker_memory_budget
from controller.control_context import ControlContext
from controller.controller_config import ControllerConfig
from controller.deploy_jobs import DeployJob, DeployJobs
from controller.upload_area import UploadArea
from controller.controller_status import hosts_to_dict, model_to_dict, node_to_dict, scale_to_dict
from controller.instance_manager import InstanceManager
from controller.instance_placer import InstancePlacer
from controller.instance_sleep import InstanceSleep
from controller.managed_instance import ManagedInstance
from controller.engine_settings import engine_config_for, instance_kv_bytes, instance_memory_bytes
from controller.model_plan import ModelPlan, plan_model
from controller.model_view import model_view
from controller.model_registry import ModelRegistry
from controller.model_spec import ModelSpec
from controller.model_state import ModelState
from controller.node_roster import NodeRoster
from controller.prefill_helper import PrefillHelper
from controller.request_mover import RequestMover
from controller.slot_outlook import SlotOutlook
from controller.slot_reclaimer import SlotReclaimer
from controller.slot_sharer import SlotSharer
from controller.usage_meter import UsageMeter
from controller.routing_table import Route, RoutingTable
from controller.spare_pool import SparePool
from controller.state_location import open_state_store
from controller.state_store import StateStore
from storage import ModelRepository, open_repository
from wire import DeployProgress, EngineGauges, InstanceLoadRecord, InstanceState, MigrationReport, ModelRecord

logger = logging.getLogger(__name__)

class Controller:
    """See the module docstring. All methods run on one event loop; `start` before anything else."""

    def __init__(self, config: ControllerConfig, cluster: ClusterClient, *, state_store: StateStore | None = None,
                 repository: ModelRepository | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._cluster = cluster
        self._store = state_store if state_store is not None else open_state_store(config.state_location)
        self._repository = repository if repository is not None else open_repository(config.repository)
        self._clock = clock
        self._wall_clock = wall_clock
        self._models: dict[str, ModelState] = {}
        self._nodes: dict[str, ClusterNode] = {}
        self._routing = RoutingTable()
        self._routing_changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._tick_lock = asyncio.Lock()
        self._recent: deque[dict[str, Any]] = deque(maxlen=config.max_recent_decisions)
        self._spares = SparePool(cluster, config.spare_workers_per_node, config.load_timeout_s,
                                 weight_bytes=config.spare_weight_bytes, kv_bytes=config.spare_kv_bytes,
                                 adopt_per_node=(config.cpu_worker_slots_per_node * config.nodes_per_ray_node
                                                 if config.worker_memory_bytes else None),
                                 host_models=config.models_per_process)
        self._background: set[asyncio.Task[None]] = set()  # drains moving requests off, DRAM promotions
        context = ControlContext(clock=clock, wall_clock=wall_clock, record=self._recent.append,
                                 background=self._background, wake=self._wake.set)
        self._instances = InstanceManager(config, cluster, self._store, self._models,
                                          on_routes_changed=self._publish_routes, context=context,
                                          before_ready=lambda instance: self._sharer.before_ready(instance),
                                          spares=self._spares if config.spare_workers_per_node else None)
        self._roster = NodeRoster(config, cluster, self._nodes, self._instances, clock=clock)
        self._num_ticks = 0
        self._last_tick_errors: list[str] = []
        self._mover = RequestMover(config, cluster, self._instances, self._nodes, context=context,
                                   is_closed=lambda: self._closed)
        self._copies = CheckpointCopies(config, cluster, self._instances, self._nodes, self._models, context=context)
        draining = self._mover.draining_node_ids
        self._reclaimer = SlotReclaimer(config, self._instances, self._mover, draining_nodes=draining, context=context)
        self._sharer = SlotSharer(config, cluster, self._instances, self._nodes, self._models, self._mover,
                                  draining_nodes=draining, shrink=self._shrink_after_eviction,
                                  keep_in_dram=self._copies.keep_in_dram, context=context)
        self._helper = PrefillHelper(config, cluster, self._instances, draining_nodes=draining, context=context)
        self._uploads = UploadArea(config.state_dir / "uploads", clock=wall_clock)
        self._registry = ModelRegistry(self._store, self._repository, self._models, lock=self._tick_lock,
                                       invalidate_copies=self._invalidate_copies,
                                       stop_instances=self._stop_deleted, usage_meter=self._usage_meter,
                                       context=context, engine_config=lambda spec: engine_config_for(spec, config),
                                       uploads=self._uploads, downloads=config.state_dir / "downloads")
        self._placer = InstancePlacer(config, self._instances, self._nodes, sharer=self._sharer,
                                      reclaimer=self._reclaimer, quota=self._registry.quota, context=context)
        self._sleep = InstanceSleep(config, self._instances, self._nodes, views=self._placer.views)
        self._deploys = DeployJobs(wall_clock=wall_clock, clock=clock)
        self._closed = False

    # --- life --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the registry, find the nodes, adopt the workers still alive."""
        self._registry.load()
        try:
            await self._roster.refresh()
        except Exception:  # noqa: BLE001 - the loop tries again; adoption needs no node list
            logger.exception("listing nodes at start failed")
        await self._instances.adopt(self._nodes)
        for model_id in self._models:
            self._publish_routes(model_id)
        logger.info("controller started: %d models, %d instances adopted, %d nodes", len(self._models),
                    len(self._instances.all()), len(self._nodes))

    async def run(self) -> None:
        """The reconcile loop: a tick every `reconcile_interval_s`, or at once when woken."""
        while not self._closed:
            try:
                await self.reconcile_once()
            except Exception:  # noqa: BLE001 - a bug in a tick must not end the loop
                logger.exception("reconcile tick failed")
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.reconcile_interval_s)
            except TimeoutError:
                pass
            self._wake.clear()

    async def shutdown(self, stop_workers: bool = True) -> None:
        """End the loop. With `stop_workers`, also stop every worker and node store (their shared
        memory is freed); without, leave them for a successor to adopt."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        await self._deploys.close()
        for task in list(self._background):
            task.cancel()  # a migration cancelled midway is undone: the request stays on its source
        await asyncio.gather(*self._background, return_exceptions=True)
        async with self._tick_lock:
            await self._instances.close(stop_workers)
            # Spares hold nothing a successor needs; a slot host holding instances left running does.
            await self._spares.close(keep_hosting=not stop_workers)
            if stop_workers:
                for node in self._nodes.values():
                    if node.store is not None:
                        try:
                            await self._cluster.stop_node_store(node.store, self.config.report_timeout_s)
                        except Exception:  # noqa: BLE001
                            logger.exception("stopping node store %s failed", node.node_id)
                        node.store = None
            self._store.close()
        logger.info("controller shut down (workers %s)", "stopped" if stop_workers else "left running")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the controller is shut down")

    # --- registry (`ModelRegistry`) ------------------------------------------------------------

    async def deploy(self, spec_data: Mapping[str, Any] | ModelSpec) -> dict[str, Any]:
        """See `ModelRegistry.deploy`."""
        self._check_open()
        return await self._registry.deploy(spec_data)

    def start_deploy(self, spec_data: Mapping[str, Any] | ModelSpec, update: bool = False) -> DeployProgress:
        """Starts a deploy (or an update) as a job and answers at once with its first record; what
        can be refused before any I/O (a bad spec, a model deployed differently or not at all, a
        deploy of it in flight) raises here as `deploy` would. The job's conversion and upload
        report their progress (`deploy_progress`). See `DeployJobs`."""
        self._check_open()
        spec = self._registry.begin(spec_data, update=update)
        action = "update" if update else "deploy"
        if spec is None:  # the same spec again: nothing to do
            model_id = self._registry.model_id_of(spec_data)
            return self._deploys.finished(model_id, action, self._registry.model(model_id).spec.to_dict())

        async def work(job: DeployJob) -> dict[str, Any]:
            return await self._registry.complete(spec, update=update, progress=job.report)

        return self._deploys.start(spec.model_id, action, work)

    def deploy_progress(self, deploy_id: str) -> DeployProgress:
        """A deploy job's record now; `UnknownDeployError` for an id it does not know."""
        return self._deploys.get(deploy_id)

    # --- uploads (`UploadArea`): a deploy's source sent through the admin API -----------------

    async def create_upload(self) -> str:
        self._check_open()
        return await asyncio.to_thread(self._uploads.create)

    async def upload_piece(self, upload_id: str, path: str, offset: int, data: bytes) -> int:
        """Appends a piece to one file of an upload at `offset`; returns the file's new size."""
        return await asyncio.to_thread(self._uploads.write, upload_id, path, offset, data)

    async def upload_status(self, upload_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(self._uploads.status, upload_id)

    async def seal_upload(self, upload_id: str, files: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        return await asyncio.to_thread(self._uploads.seal, upload_id, {k: dict(v) for k, v in files.items()})

    async def delete_upload(self, upload_id: str) -> None:
        await asyncio.to_thread(self._uploads.delete, upload_id)

    async def wait_deploy(self, deploy_id: str, timeout_s: float) -> DeployProgress:
        """A deploy job's record once it finished, or after `timeout_s` (a long poll)."""
        return await self._deploys.wait(deploy_id, timeout_s)

    def recent_deploys(self) -> list[DeployProgress]:
        """The deploy jobs this controller remembers, oldest first (running ones always)."""
        return self._deploys.recent()

    async def update(self, spec_data: Mapping[str, Any] | ModelSpec) -> dict[str, Any]:
        """See `ModelRegistry.update`."""
        self._check_open()
        return await self._registry.update(spec_data)

    async def delete(self, model_id: str) -> None:
        """See `ModelRegistry.delete`."""
        self._check_open()
        await self._registry.delete(model_id)

    async def scale(self, model_id: str, min_instances: int | None = None,
                    max_instances: int | None = None) -> dict[str, Any]:
        """See `ModelRegistry.scale`."""
        self._check_open()
        return await self._registry.scale(model_id, min_instances, max_instances)

    def list_models(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return self._registry.list_models(tenant)

    def model_records(self) -> list[ModelRecord]:
        """Every deployed model as the gateway reads it (`wire.ModelRecord`: its queue limits,
        when it was deployed, how its instances were loaded), sorted by model id."""
        return [self._model_record(state) for _, state in sorted(self._models.items())]

    def model_record(self, model_id: str) -> ModelRecord:
        """One model's `wire.ModelRecord`; `InvalidSpecError` for a malformed id, `UnknownModelError`."""
        return self._model_record(self._registry.model(model_id))

    def _model_record(self, state: ModelState) -> ModelRecord:
        return state.record(InstanceLoadRecord(instance_id=i.instance_id, tier=i.tier, load_s=i.load_s)
                            for i in self._instances.of_model(state.model_id))

    def get_model(self, model_id: str) -> dict[str, Any]:
        """Spec, instances, desired count, queue, last scale decision, last placement with estimates,
        and the estimated restart time its keep-alive may follow (None before its first start)."""
        state = self._registry.model(model_id)
        now = self._clock()
        return {
            "model_id": model_id, "spec": state.spec.to_dict(), "repository_name": state.repository_name,
            "num_bytes": state.num_bytes, "restart_s": state.restart_s,
            "num_desired_instances": state.num_desired_instances,
            "num_queued_requests": state.num_queued_requests(now, self.config.queue_report_ttl_s),
            "instances": [instance.to_dict() for instance in self._instances.of_model(model_id)],
            "last_scale": state.last_scale, "last_placement": state.last_placement,
        }

    def set_tenant_quota(self, tenant: str, quota: Mapping[str, Any]) -> dict[str, Any]:
        """See `ModelRegistry.set_tenant_quota`."""
        self._check_open()
        return self._registry.set_tenant_quota(tenant, quota)

    def tenant_quotas(self) -> dict[str, dict[str, Any]]:
        return self._registry.tenant_quotas()

    async def _invalidate_copies(self, name: str) -> None:
        """Drops every node's copy of repository model `name` (its content changed)."""
        calls = [self._cluster.invalidate_checkpoint(node.store, name, tier, self.config.report_timeout_s)
                 for node in self._nodes.values() if node.store is not None
                 for tier in (("dram", "ssd") if self.config.dram_capacity_bytes > 0 else ("ssd",))]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                logger.warning("dropping a node's stale copy of %s failed: %s", name, result)

    def _stop_deleted(self, model_id: str) -> list[asyncio.Task]:
        """A deleted model: nothing held for it, its instances stopped (open requests aborted)."""
        self._reclaimer.forget(model_id, "model deleted")
        self._sharer.model_deleted(model_id)
        return [self._instances.begin_stop(instance, "model deleted", 0.0)
                for instance in self._instances.of_model(model_id)]

    def engine_gauges(self) -> list[EngineGauges]:
        """Every ready instance's engine load as last reported (what the gateways export on
        ``/metrics`` for all nodes), by instance id."""
        return self._instances.engine_gauges()

    def slot_sharing_counts(self) -> dict[str, int]:
        """How often slots changed hands since this controller started (evictions, preemptions,
        suspended and resumed requests, instances put to sleep and woken...): what the gateways
        export on ``/metrics``."""
        return {**self._sharer.counts(), "sleeps": self._instances.counts["sleeps"],
                "wakes": self._instances.counts["wakes"]}

    # --- the gateway's side ------------------------------------------------------------------

    def notify_demand(self, model_id: str, num_queued: int, reporter: str = "gateway",
                      oldest_wait_s: float = 0.0, newest_wait_s: float = 0.0) -> SlotOutlook:
        """`num_queued` requests wait for `model_id` at `reporter` now, the oldest of them for
        `oldest_wait_s` and the newest for `newest_wait_s` (levels, not increments; repeat them
        while they wait, they expire after `queue_report_ttl_s`). Wakes the loop: a model at zero starts on this tick. Returns where
        the model stands (`SlotOutlook`), which the gateway shows its waiting clients."""
        self._check_open()
        if not isinstance(num_queued, int) or isinstance(num_queued, bool) or num_queued < 0:
            raise ValueError(f"num_queued must be an integer >= 0, got {num_queued!r}")
        if not isinstance(oldest_wait_s, (int, float)) or isinstance(oldest_wait_s, bool) \
                or not 0 <= oldest_wait_s < float("inf"):
            raise ValueError(f"oldest_wait_s must be a finite number >= 0, got {oldest_wait_s!r}")
        if not isinstance(newest_wait_s, (int, float)) or isinstance(newest_wait_s, bool) \
                or not 0 <= newest_wait_s <= oldest_wait_s:
            raise ValueError(f"newest_wait_s must be a number from 0 to oldest_wait_s ({oldest_wait_s!r}), "
                             f"got {newest_wait_s!r}")
        now = self._clock()
        self._registry.model(model_id).report_queue(str(reporter), num_queued, now, float(oldest_wait_s),
                                                    float(newest_wait_s))
        if num_queued > 0:
            self._wake.set()
        return self._sharer.outlook(model_id, now)

    def _usage_meter(self) -> UsageMeter:
        sharing = self.config.slot_sharing
        return UsageMeter(sharing.eviction.usage_half_life_s if sharing else 300.0)

    def _shrink_after_eviction(self, model_id: str, reason: str) -> None:
        """An idle instance of the model was evicted: it wants one instance fewer (not below its
        min), so its autoscaler does not start it again without demand."""
        state = self._models.get(model_id)
        if state is None:
            return
        target = max(state.spec.autoscaling.min_instances, state.num_desired_instances - 1)
        if target != state.num_desired_instances:
            self._store.set_desired_instances(model_id, target)
            state.num_desired_instances = target
        state.autoscale_state = AutoscaleState()
        logger.info("%s: desired instances %d: %s", model_id, target, reason)

    async def routing_table(self, known_version: int = -1, timeout_s: float = 0.0
                            ) -> tuple[int, dict[str, list[dict[str, Any]]]]:
        """(version, model id -> ready instances). When the caller already holds the current
        version, waits up to `timeout_s` for a change (a long poll); always returns the whole table."""
        if known_version == self._routing.version and timeout_s > 0:
            try:
                await asyncio.wait_for(self._routing_changed.wait(), timeout_s)
            except TimeoutError:
                pass
        return self._routing.snapshot()

    def _publish_routes(self, model_id: str) -> None:
        routes = [Route(i.instance_id, i.actor_name, self._cluster.namespace, i.node_id, i.num_ongoing_requests,
                        hosted=i.hosted) for i in self._instances.ready_routes(model_id)]
        if routes:
            self._sharer.model_ready(model_id)
        if self._routing.set_routes(model_id, routes if model_id in self._models else []):
            self._routing_changed.set()
            self._routing_changed = asyncio.Event()

    # --- the reconcile tick ------------------------------------------------------------------

    async def reconcile_once(self) -> dict[str, Any]:
        """One tick (see the module docstring); returns what it did, for tests and logs."""
        if self._closed:
            return {"errors": ["shut down"]}
        async with self._tick_lock:
            errors: list[str] = []
            for name, step in (("nodes", self._roster.refresh), ("reports", self._roster.gather_reports),
                               ("handoffs", self._helper.hand_over_waiting), ("prices", self._price_adopted),
                               ("autoscale", self._autoscale), ("pins", self._copies.reconcile_pins),
                               ("promote", self._promote_to_dram), ("spares", self._replenish_spares)):
                try:
                    errors += await step() or []
                except Exception as exc:  # noqa: BLE001 - one failed step must not stop the others
                    logger.exception("reconcile step %s failed", name)
                    errors.append(f"{name}: {type(exc).__name__}: {exc}")
            for model_id in set(self._models) | {i.model_id for i in self._instances.all()}:
                self._publish_routes(model_id)
            self._num_ticks += 1
            self._last_tick_errors = errors
            return {"tick": self._num_ticks, "errors": errors, "routing_version": self._routing.version,
                    "num_desired_instances": {m: s.num_desired_instances for m, s in sorted(self._models.items())}}

    async def _price_adopted(self) -> list[str]:
        """Where memory is the slot, instances adopted after a restart take their share of their
        node's budget (and a sleeper its weights') from the first tick that can read their model's
        size, not from their model's next start: until then placement would count it free."""
        if not any(has_worker_memory_budget(node, self.config) for node in self._nodes.values()):
            return []
        for model_id in sorted({i.model_id for i in self._instances.all() if i.memory_bytes == 0}):
            model = self._models.get(model_id)
            if model is not None and model.num_bytes is None:
                name = model.repository_name
                model.num_bytes = await asyncio.to_thread(lambda: self._repository.describe(name).total_bytes)
        self._instances.price_adopted(lambda m: (instance_memory_bytes(m.spec, m.num_bytes, self.config),
                                                 instance_kv_bytes(m.spec, self.config)) if m.num_bytes else None)
        return []

    def _settling_instances(self) -> list[ManagedInstance]:
        """Instances still loading or ready for less than `spare_refill_delay_s`: their nodes
        get no background work (a spare's start, a DRAM promotion) that would compete with a
        cold start or its first requests for the node's CPUs."""
        now, settle_s = self._clock(), self.config.spare_refill_delay_s
        return [i for i in self._instances.all()
                if i.phase is InstanceState.LOADING or (i.ready_s is not None and now - i.ready_s < settle_s)]

    async def _promote_to_dram(self) -> list[str]:
        self._copies.promote_to_dram({i.node_id for i in self._settling_instances()})
        return []

    async def _replenish_spares(self) -> list[str]:
        """Spares refilled, off settling nodes. Where memory is the slot, a Ray node keeps a warm
        worker process per CPU slot of its logical nodes (the slot hosts' seed): its instances'
        poolable processes (those reserving no Ray CPU, sleepers included) count toward them."""
        busy = {i.ray_node_id for i in self._settling_instances()}
        hosts: dict[str, int] = {}
        gpu_hosts: set[str] = set()  # GPU nodes sharing their GPUs by memory: a host per GPU
        for node in self._nodes.values():
            if has_worker_memory_budget(node, self.config):
                hosts[node.ray_node_id] = hosts.get(node.ray_node_id, 0) + node.num_slots
                if node.num_gpus:
                    gpu_hosts.add(node.ray_node_id)
        in_use: dict[str, int] = {}
        for instance in self._instances.all():
            if instance.reusable_process and not instance.hosted:  # a hosted one is in a pool process
                in_use[instance.ray_node_id] = in_use.get(instance.ray_node_id, 0) + 1
        return self._spares.replenish(sorted({node.ray_node_id for node in self._nodes.values()}),
                                      busy_ray_node_ids=busy, hosts=hosts, in_use=in_use, gpu_ray_node_ids=gpu_hosts)

    async def _autoscale(self) -> list[str]:
        errors = []
        for model in self._sharer.order(list(self._models.values()), self._clock()):
            try:
                await self._autoscale_model(model)
            except Exception as exc:  # noqa: BLE001 - one model's trouble must not hold up the others
                logger.exception("autoscaling %s failed", model.model_id)
                errors.append(f"{model.model_id}: {type(exc).__name__}: {exc}")
        return errors

    async def _autoscale_model(self, model: ModelState) -> None:
        """Plans the model's tick (`plan_model`: the one planner, the simulator's too) and carries
        the plan out."""
        now = self._clock()
        live = self._instances.live(model.model_id)
        ongoing = sum(i.num_ongoing_requests for i in live if i.phase is InstanceState.READY)
        queued = model.num_queued_requests(now, self.config.queue_report_ttl_s)
        if ongoing or queued:
            model.last_request_s = now
        view = model_view(model, live, self._instances.asleep(model.model_id), num_ongoing_requests=ongoing,
                          num_queued_requests=queued, keep_alive_floor_s=self._sharer.keep_alive_floor_s(now))
        plan = plan_model(view, now)
        model.autoscale_state = plan.autoscale_state
        model.last_scale = scale_to_dict(model.model_id, plan.previous_count, plan.decision, self._wall_clock())
        if plan.changes_count:
            # Durable first: if the store fails, the change is not made and the next tick retries.
            self._store.set_desired_instances(model.model_id, plan.num_desired_instances)
            model.num_desired_instances = plan.num_desired_instances
            self._record(model.last_scale)
            logger.info("%s: %s", model.model_id, plan.decision.reason)
        else:
            logger.debug("%s: %s", model.model_id, plan.decision.reason)
        await self._carry_out(model, plan, now)

    async def _carry_out(self, model: ModelState, plan: ModelPlan, now: float) -> None:
        if plan.releases_holds:
            self._reclaimer.forget(model.model_id, "no longer needed: the model scaled back down")
            self._sharer.forget(model.model_id, "no longer needed: the model has its instances")
        for instance_id in plan.scale_down:
            instance = self._instances.get(instance_id)
            if instance is not None:
                self._sleep.scale_down(instance, f"scaling down to {model.num_desired_instances}")
        missing = plan.num_missing
        if missing:
            missing -= self._sleep.wake(model, missing, now, order=plan.wake_order)
        if missing == 0 or not plan.may_place:
            return
        if model.num_bytes is None:
            name = model.repository_name
            model.num_bytes = await asyncio.to_thread(lambda: self._repository.describe(name).total_bytes)
        for _ in range(missing):
            if self._models.get(model.model_id) is not model or not self._placer.place_and_start(model, now):
                break

    # --- operations --------------------------------------------------------------------------

    async def migrate(self, instance_id: str, request_id: str | None = None, *, to_node: str | None = None,
                      to_instance: str | None = None, method: str = "kv") -> MigrationReport:
        """Live-migrates one request (``request_id``) or every request of an instance to another
        ready instance of the same model: the one named, the least loaded on ``to_node``, or the
        least loaded anywhere (`choose_destination`). Clients following the requests through the
        gateway see nothing. Returns a `MigrationReport`: the source, the destination and one
        outcome per request (a request that could not move keeps running on its source, whole).

        Raises `InvalidMigrationError` for a malformed call, `UnknownInstanceError` /
        `LookupError` for an unknown instance / node, `MigrationConflictError` when no
        destination can take the requests now."""
        self._check_open()
        return await self._mover.migrate(instance_id, request_id, to_node=to_node, to_instance=to_instance,
                                         method=method)

    async def drain_node(self, node_id: str, migrate: bool = True) -> dict[str, Any]:
        """Place nothing more on the node and stop its instances, moving their requests off first:
        each instance leaves routing at once and, with `migrate`, its running requests are
        live-migrated (in the background) to a ready instance of the same model elsewhere, the
        autoscaler starting one if there is none; an instance stops once it has no open request
        (or after `drain_timeout_s`). Held in memory only: a restarted controller places on the
        node again."""
        self._check_open()
        return self._mover.drain_node(node_id, migrate)

    def undrain_node(self, node_id: str) -> dict[str, Any]:
        """Let placement use a drained node again."""
        return self._mover.undrain_node(node_id)

    def status(self) -> dict[str, Any]:
        """Everything ``thaw status`` shows: models, instances, nodes, recent decisions."""
        now = self._clock()
        instances = self._instances.all()
        models = [model_to_dict(state, [i for i in instances if i.model_id == model_id], now,
                                self.config.queue_report_ttl_s) for model_id, state in sorted(self._models.items())]
        sharing = self._sharer.status(now)
        sharing["counts"] = self.slot_sharing_counts()  # the sharer's, with sleeps and wakes
        return {
            "namespace": self._cluster.namespace, "platform_id": self.config.effective_platform_id,
            "num_ticks": self._num_ticks, "last_tick_errors": list(self._last_tick_errors),
            "routing_version": self._routing.version, "models": models,
            "instances": [i.to_dict() for i in instances],
            "nodes": [node_to_dict(node, instances, self.config)
                      for _, node in sorted(self._nodes.items())],
            "spare_workers": self._spares.counts(),
            "hosts": hosts_to_dict(self._spares.hosts(), instances),
            "worker_processes_started": {"spares": self._spares.num_started,
                                         "instances": self._instances.counts["fresh_workers"]},
            "slot_reclaims": self._reclaimer.pending(),
            "slot_sharing": sharing,
            "recent_decisions": list(self._recent),
            "deploys": [record.to_dict() for record in self._deploys.recent()],
        }

    def _record(self, decision: dict[str, Any]) -> None:
        self._recent.append(decision)
