"""The controller as a detached, named Ray actor, and the helpers to start, find and stop it.

`ControllerActor` is an async actor: every method runs on one event loop beside the reconcile
loop (a background task started in ``__init__``), so the routing table is served while a tick
waits on reports, and nothing needs a lock but the tick itself. It only forwards to
`Controller`, which is tested without Ray; `RayClusterClient` is what it talks to the cluster
through. Beside it the actor keeps one relay that is not controller logic: the gateway replicas'
per-request metrics (`GatewayMetricsBoard`), handed from each replica to its peers.

Detached, so the platform outlives the process that started it (``thaw serve``); named
(``thaw-controller`` by default) in the platform's namespace, so the gateway and the CLI find it
with ``get_controller(namespace=...)``. Killing it loses nothing: specs, desired counts and the
worker registry are in the state store, and a new one started on the same config adopts the
workers still running (`Controller.start`). Ray restarts it after a crash of its process
(``max_restarts=-1``), with the same effect.

The gateway's side::

    controller = get_controller(namespace="thaw")
    version, table = await controller.routing_table.remote(-1)
    while True:  # in a background task: a long poll returns at once on a change
        version, table = await controller.routing_table.remote(version, timeout_s=5.0)
    # a request for a model with no route: report the queue (repeat every ~1 s while it waits)
    await controller.notify_demand.remote("acme/llama-8b", num_queued, "gateway-0")
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from controller.cluster_node import NODE_ID_PREFIX_CHARS
from controller.controller import Controller
from controller.controller_config import ControllerConfig
from controller.gateway_metrics_board import GatewayMetricsBoard
from controller.ray_cluster_client import RayClusterClient
from controller.slot_outlook import SlotOutlook
from wire import DeployProgress, EngineGauges, GatewayMetricsSnapshot, MigrationReport, ModelRecord

DEFAULT_CONTROLLER_NAME = "thaw-controller"
logger = logging.getLogger(__name__)


class ControllerActor:
    """Ray actor body over `Controller` (see the module docstring)."""

    async def __init__(self, config: ControllerConfig) -> None:
        # The actor's process is its own: its decisions (scale, placement, lifecycle) go to the
        # Ray worker log at INFO, where ``ray logs`` and the driver's console find them.
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._controller = Controller(config, RayClusterClient(config.namespace, config.repository))
        self._gateway_metrics = GatewayMetricsBoard()
        await self._controller.start()
        self._loop_task = asyncio.get_running_loop().create_task(self._controller.run())

    async def deploy(self, spec: dict[str, Any]) -> dict[str, Any]:
        return await self._controller.deploy(spec)

    async def start_deploy(self, spec: dict[str, Any], update: bool = False) -> DeployProgress:
        return self._controller.start_deploy(spec, update)

    async def deploy_progress(self, deploy_id: str) -> DeployProgress:
        return self._controller.deploy_progress(deploy_id)

    async def wait_deploy(self, deploy_id: str, timeout_s: float) -> DeployProgress:
        return await self._controller.wait_deploy(deploy_id, timeout_s)

    async def recent_deploys(self) -> list[DeployProgress]:
        return self._controller.recent_deploys()

    async def create_upload(self) -> str:
        return await self._controller.create_upload()

    async def upload_piece(self, upload_id: str, path: str, offset: int, data: bytes) -> int:
        return await self._controller.upload_piece(upload_id, path, offset, data)

    async def upload_status(self, upload_id: str) -> dict[str, Any]:
        return await self._controller.upload_status(upload_id)

    async def seal_upload(self, upload_id: str, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return await self._controller.seal_upload(upload_id, files)

    async def delete_upload(self, upload_id: str) -> None:
        await self._controller.delete_upload(upload_id)

    async def update(self, spec: dict[str, Any]) -> dict[str, Any]:
        return await self._controller.update(spec)

    async def delete(self, model_id: str) -> None:
        await self._controller.delete(model_id)

    async def scale(self, model_id: str, min_instances: int | None = None,
                    max_instances: int | None = None) -> dict[str, Any]:
        return await self._controller.scale(model_id, min_instances, max_instances)

    async def list_models(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return self._controller.list_models(tenant)

    async def get_model(self, model_id: str) -> dict[str, Any]:
        return self._controller.get_model(model_id)

    async def model_records(self) -> list[ModelRecord]:
        return self._controller.model_records()

    async def model_record(self, model_id: str) -> ModelRecord:
        return self._controller.model_record(model_id)

    async def set_tenant_quota(self, tenant: str, quota: dict[str, Any]) -> dict[str, Any]:
        return self._controller.set_tenant_quota(tenant, quota)

    async def engine_gauges(self) -> list[EngineGauges]:
        return self._controller.engine_gauges()

    async def slot_sharing_counts(self) -> dict[str, int]:
        return self._controller.slot_sharing_counts()

    async def exchange_gateway_metrics(self, snapshot: GatewayMetricsSnapshot) -> list[GatewayMetricsSnapshot]:
        """Keeps a gateway replica's per-request series; returns its live peers' (`GatewayMetricsBoard`)."""
        return self._gateway_metrics.exchange(snapshot)

    async def tenant_quotas(self) -> dict[str, dict[str, Any]]:
        return self._controller.tenant_quotas()

    async def notify_demand(self, model_id: str, num_queued: int, reporter: str = "gateway",
                            oldest_wait_s: float = 0.0, newest_wait_s: float = 0.0) -> SlotOutlook:
        return self._controller.notify_demand(model_id, num_queued, reporter, oldest_wait_s, newest_wait_s)

    async def routing_table(self, known_version: int = -1, timeout_s: float = 0.0
                            ) -> tuple[int, dict[str, list[dict[str, Any]]]]:
        return await self._controller.routing_table(known_version, timeout_s)

    async def status(self) -> dict[str, Any]:
        import ray

        # Where the controller runs: Ray may have restarted it on another node (its node was lost).
        ray_node_id = ray.get_runtime_context().get_node_id()
        return {**self._controller.status(),
                "controller": {"ray_node_id": ray_node_id, "node_id": ray_node_id[:NODE_ID_PREFIX_CHARS]}}

    async def config(self) -> ControllerConfig:
        """The configuration this controller runs with (to start its successor elsewhere)."""
        return self._controller.config

    async def drain_node(self, node_id: str, migrate: bool = True) -> dict[str, Any]:
        return await self._controller.drain_node(node_id, migrate)

    async def migrate(self, instance_id: str, request_id: str | None = None, *, to_node: str | None = None,
                      to_instance: str | None = None, method: str = "kv") -> MigrationReport:
        return await self._controller.migrate(instance_id, request_id, to_node=to_node, to_instance=to_instance,
                                              method=method)

    async def undrain_node(self, node_id: str) -> dict[str, Any]:
        return self._controller.undrain_node(node_id)

    async def reconcile_once(self) -> dict[str, Any]:
        return await self._controller.reconcile_once()

    async def shutdown(self, stop_workers: bool = True) -> None:
        await self._controller.shutdown(stop_workers)
        self._loop_task.cancel()
        await asyncio.gather(self._loop_task, return_exceptions=True)

    async def ping(self) -> bool:
        return True


def start_controller(config: ControllerConfig, *, name: str = DEFAULT_CONTROLLER_NAME, detached: bool = True,
                     **options: Any):
    """Start the controller actor in ``config.namespace`` and return its handle (it is serving
    once ``ping`` answers: ``__init__`` adopts the running workers first). Uses no CPU slot."""
    import ray

    actor_options: dict[str, Any] = {"name": name, "namespace": config.namespace, "num_cpus": 0,
                                     "max_restarts": -1, "max_concurrency": 1000}
    if detached:
        actor_options["lifetime"] = "detached"
    actor_options.update(options)
    return ray.remote(ControllerActor).options(**actor_options).remote(config)


def get_controller(name: str = DEFAULT_CONTROLLER_NAME, namespace: str = "thaw"):
    """The running controller's handle; raises `ValueError` if there is none."""
    import ray

    return ray.get_actor(name, namespace=namespace)


def stop_controller(handle, stop_workers: bool = True, timeout_s: float = 120.0) -> None:
    """Shut the controller down (with its workers and node stores unless `stop_workers` is
    False), then end its actor."""
    import ray

    try:
        ray.get(handle.shutdown.remote(stop_workers), timeout=timeout_s)
    except ray.exceptions.RayActorError:
        pass
    finally:
        ray.kill(handle, no_restart=True)
