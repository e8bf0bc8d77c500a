"""`ClusterClient` over Ray: named, detached actors in the platform's namespace.

Worker and node-store actors are detached, so they outlive the controller that started them: a
killed or upgraded controller leaves the platform serving, and its successor finds them again
by name (`ray.get_actor(name, namespace)`) instead of starting duplicates. Workers are pinned to
their node with hard node affinity (placement chose the node for its checkpoint's locality).
Every worker, spares included, is a `migration.MigratableInstanceActor`: an instance worker that
can also hand its requests to another and take theirs in, so drain, rebalancing and the
gateway's recovery can move any request the platform serves.

Every actor call is awaited through `wire.call`, which translates Ray's errors the way every
other Ray caller in thaw does: a dead actor becomes `ActorGoneError`, an actor that is only
unreachable for now (`wire.ActorUnreachableError`) or slow becomes a `TimeoutError`, and an error
the actor raised on purpose (e.g. a failed load, a full tier) is raised as itself. Blocking Ray
calls (name lookups, node listing) run in a thread so they never stall the controller's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from controller.cluster_client import (NODE_STORE_ACTOR_PREFIX, WORKER_ACTOR_PREFIX, ActorGoneError, ActorHandle,
                                       ClusterClient, node_store_actor_name)
from controller.cluster_node import RayNodeInfo
from storage import NodeStoreConfig, NodeStoreReport, RepositoryConfig
from wire import HostedInstance, InstanceLoad, InstanceStats, call, is_hosted, is_slot_host

if TYPE_CHECKING:
    from loader import StreamConfig
    from migration import MigrationOutcome, ParkedRequest
    from worker import EngineConfig, PeerWeights

logger = logging.getLogger(__name__)


ACCELERATOR_RESOURCE_PREFIX = "accelerator_type:"  # Ray's resource naming a node's GPUs, e.g. accelerator_type:H200


def accelerator_kind(resources: dict[str, float]) -> str | None:
    """The kind of a Ray node's accelerators from its resources, None when Ray names none."""
    kinds = sorted(name.removeprefix(ACCELERATOR_RESOURCE_PREFIX) for name in resources
                   if name.startswith(ACCELERATOR_RESOURCE_PREFIX))
    return kinds[0] if kinds else None


def live_ray_nodes(nodes: list[dict]) -> list[RayNodeInfo]:
    """The live nodes of ``ray.nodes()``'s answer as typed records: the one reading of Ray's node
    dicts, for the controller and for the platform's own start."""
    return [RayNodeInfo(ray_node_id=node["NodeID"], num_gpus=int(node.get("Resources", {}).get("GPU", 0)),
                        accelerator=accelerator_kind(node.get("Resources", {})))
            for node in nodes if node.get("Alive")]


class RayClusterClient(ClusterClient):
    """The cluster through Ray; every actor it names lives in `namespace`."""

    def __init__(self, namespace: str, repository: RepositoryConfig) -> None:
        self.namespace = namespace
        self._repository = repository

    async def list_nodes(self) -> list[RayNodeInfo]:
        import ray

        return live_ray_nodes(await asyncio.to_thread(ray.nodes))

    async def _find(self, name: str) -> ActorHandle | None:
        import ray

        try:
            return await asyncio.to_thread(ray.get_actor, name, namespace=self.namespace)
        except ValueError:  # no live actor of that name
            return None

    # --- node stores ------------------------------------------------------------------------

    async def connect_node_store(self, node_id: str, ray_node_id: str, config: NodeStoreConfig) -> ActorHandle:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from storage import start_node_store

        name = node_store_actor_name(node_id)
        handle = await self._find(name)
        if handle is not None:
            return handle
        try:
            handle = start_node_store(
                config, self._repository, name=name, namespace=self.namespace, lifetime="detached",
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=ray_node_id, soft=False))
        except ray.exceptions.ActorAlreadyExistsError:  # started between the lookup and here
            handle = await self._find(name)
            if handle is None:
                raise
        logger.info("started node store %s on Ray node %s", name, ray_node_id)
        return handle

    async def node_store_report(self, store: ActorHandle, timeout_s: float) -> NodeStoreReport:
        return await call(store.report.remote(), timeout_s)

    async def pin_checkpoint(self, store: ActorHandle, model: str, tier: str, timeout_s: float) -> str:
        return await call(store.pin.remote(model, tier), timeout_s)

    async def prefetch_checkpoint(self, store: ActorHandle, model: str, tier: str, timeout_s: float) -> str:
        return await call(store.ensure.remote(model, tier), timeout_s)

    async def unpin_checkpoint(self, store: ActorHandle, model: str, tier: str, timeout_s: float) -> bool:
        return await call(store.unpin.remote(model, tier), timeout_s)

    async def invalidate_checkpoint(self, store: ActorHandle, model: str, tier: str, timeout_s: float) -> bool:
        return await call(store.invalidate.remote(model, tier), timeout_s)

    async def stop_node_store(self, store: ActorHandle, timeout_s: float) -> None:
        import ray

        try:
            await call(store.close.remote(), timeout_s)
        except (ActorGoneError, TimeoutError):
            pass
        finally:
            ray.kill(store, no_restart=True)

    # --- workers ----------------------------------------------------------------------------

    def start_worker(self, *, instance_id: str, model_id: str, model_dir: str | None, engine_config: EngineConfig,
                     actor_name: str, ray_node_id: str, num_cpus: float, num_gpus: float,
                     peer: PeerWeights | None = None, num_threads: int | None = None) -> ActorHandle:
        from migration import start_migratable_instance

        return start_migratable_instance(instance_id, model_id, model_dir, engine_config, name=actor_name,
                                         namespace=self.namespace, node_id=ray_node_id, num_cpus=num_cpus,
                                         num_gpus=num_gpus, detached=True, peer=peer, num_threads=num_threads)

    def start_spare_worker(self, *, actor_name: str, ray_node_id: str, host_models: int = 1,
                           num_gpus: int = 0) -> ActorHandle:
        from migration import start_migratable_spare, start_slot_host

        if host_models > 1:
            return start_slot_host(max_instances=host_models, name=actor_name, namespace=self.namespace,
                                   node_id=ray_node_id, detached=True, num_gpus=num_gpus)
        if num_gpus:
            raise ValueError("a spare worker owning a GPU is a slot host: it needs host_models > 1")
        return start_migratable_spare(name=actor_name, namespace=self.namespace, node_id=ray_node_id, detached=True)

    async def spare_warm(self, handle: ActorHandle, timeout_s: float, *, weight_bytes: int = 0,
                         kv_bytes: int = 0) -> float:
        return await call(handle.warm.remote(weight_bytes, kv_bytes), timeout_s)

    async def assign_worker(self, handle: ActorHandle, *, instance_id: str, model_id: str, model_dir: str | None,
                            engine_config: EngineConfig, num_threads: int, timeout_s: float,
                            peer: PeerWeights | None = None, step_priority: int = 0) -> None:
        await call(handle.assign.remote(instance_id, model_id, model_dir, engine_config, num_threads, peer,
                                        step_priority), timeout_s)

    async def stream_weights(self, handle: ActorHandle, num_receivers: int, config: StreamConfig | None,
                             timeout_s: float) -> PeerWeights:
        return await call(handle.stream_weights.remote(num_receivers, config), timeout_s)

    async def supply_fallback(self, handle: ActorHandle, model_dir: str, timeout_s: float) -> None:
        await call(handle.supply_fallback.remote(model_dir), timeout_s)

    async def find_worker(self, actor_name: str, instance_id: str | None = None) -> ActorHandle | None:
        handle = await self._find(actor_name)
        if handle is not None and instance_id is not None and is_slot_host(handle):
            return HostedInstance(handle, instance_id)  # an instance in a slot host: called through it
        return handle

    async def worker_ready(self, handle: ActorHandle, timeout_s: float) -> InstanceLoad:
        return await call(handle.ready.remote(), timeout_s)

    async def worker_stats(self, handle: ActorHandle, timeout_s: float) -> InstanceStats:
        return await call(handle.stats.remote(), timeout_s)

    async def stop_worker(self, handle: ActorHandle, timeout_s: float) -> None:
        import ray

        if is_hosted(handle):  # unloaded from its slot host; the host stays for the next model
            try:
                await call(handle.host.unload.remote(handle.instance_id, timeout_s), timeout_s + 5.0)
            except (ActorGoneError, TimeoutError):
                pass
            return
        try:
            await call(handle.shutdown.remote(timeout_s), timeout_s + 5.0)
        except (ActorGoneError, TimeoutError):
            pass
        finally:
            ray.kill(handle, no_restart=True)

    async def release_worker(self, handle: ActorHandle, timeout_s: float) -> None:
        await call(handle.release_model.remote(timeout_s), timeout_s + 5.0)

    async def sleep_worker(self, handle: ActorHandle, timeout_s: float) -> int:
        return await call(handle.sleep.remote(), timeout_s)

    async def wake_worker(self, handle: ActorHandle, timeout_s: float) -> None:
        await call(handle.wake.remote(), timeout_s)

    async def worker_request_ids(self, handle: ActorHandle, timeout_s: float) -> list[str]:
        return await call(handle.request_ids.remote(), timeout_s)

    async def park_requests(self, handle: ActorHandle, instance_id: str, max_bytes: int,
                            timeout_s: float) -> dict[str, ParkedRequest]:
        from migration import ParkingEndpoint, RayEndpoint, RayObjectKVTransport, migrate_by_kv

        request_ids = await self.worker_request_ids(handle, timeout_s)
        parking = ParkingEndpoint(RayObjectKVTransport().keep, max_bytes)
        source = RayEndpoint(handle, instance_id)
        # The protocol never raises for one request; the deadline bounds a hung instance (a
        # cancelled migration is undone: the request stays, and is suspended by its tokens).
        await asyncio.wait_for(asyncio.gather(*(migrate_by_kv(source, parking, rid) for rid in request_ids)),
                               timeout_s)
        return dict(parking.parked)

    async def unpark_requests(self, handle: ActorHandle, instance_id: str, parked: list[ParkedRequest],
                              timeout_s: float) -> list[str]:
        from migration import RayEndpoint, replay

        dest = RayEndpoint(handle, instance_id)
        results = await asyncio.wait_for(asyncio.gather(*(replay(p, dest) for p in parked), return_exceptions=True),
                                         timeout_s)
        return [p.request_id for p, result in zip(parked, results) if not isinstance(result, BaseException)]

    async def suspend_requests(self, handle: ActorHandle, timeout_s: float) -> list[str]:
        return await call(handle.suspend_requests.remote(), timeout_s)

    async def migrate_requests(self, source: ActorHandle, source_instance_id: str, dest: ActorHandle,
                               dest_instance_id: str, request_ids: list[str], method: str,
                               timeout_s: float) -> list[MigrationOutcome]:
        from migration import RayEndpoint, migrate_requests

        # The protocols never raise for a failed migration and undo it themselves; the deadline
        # only bounds a hung instance (cancelling a protocol also undoes it).
        return await asyncio.wait_for(
            migrate_requests(RayEndpoint(source, source_instance_id), RayEndpoint(dest, dest_instance_id),
                             request_ids, method), timeout_s)

    async def list_worker_actor_names(self) -> list[str]:
        return [name for name in await self._list_names() if name.startswith(WORKER_ACTOR_PREFIX)]

    async def list_node_store_actor_names(self) -> list[str]:
        return [name for name in await self._list_names() if name.startswith(NODE_STORE_ACTOR_PREFIX)]

    async def _list_names(self) -> list[str]:
        import ray

        entries = await asyncio.to_thread(ray.util.list_named_actors, True)
        return sorted(entry["name"] for entry in entries if entry["namespace"] == self.namespace)

    async def kill_worker(self, actor_name: str) -> None:
        import ray

        handle = await self._find(actor_name)
        if handle is not None:
            ray.kill(handle, no_restart=True)
