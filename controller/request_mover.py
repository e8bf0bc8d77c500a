"""Moving running requests between instances on the controller's behalf: `RequestMover`.

What ``thaw migrate`` and a node drain ask of the controller. `drain_node` takes a node out of
placement (`draining_node_ids`, which every placing collaborator reads) and stops its instances,
moving their requests off first; `undrain_node` gives it back. `migrate` checks the call (each
bad field named), picks a destination with the pure `choose_destination` policy (a named
instance, the least loaded on a node, or the least loaded anywhere, never on a draining node)
and has the cluster live-migrate the requests; each migration is recorded as a decision, so it
shows in ``thaw status`` and the log. `move_off` is a drain's loop for one instance: it moves
whatever requests are left as soon as a destination is ready, until none is left or the drain's
deadline passes. A request that cannot move keeps running on its source, whole (the migration
protocols are abort-safe), so nothing here can lose one.

Split out of `controller.Controller`, which owns the state this reads (instances, nodes) and
forwards its ``migrate``, ``drain_node`` and ``undrain_node`` here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from controller.control_context import ControlContext
from controller.cluster_client import ActorGoneError, ClusterClient
from controller.cluster_node import ClusterNode
from controller.controller_config import ControllerConfig
from controller.controller_errors import InvalidMigrationError, MigrationConflictError, UnknownInstanceError
from controller.instance_manager import InstanceManager
from controller.managed_instance import ManagedInstance
from controller.migration_policy import choose_destination
from wire import InstanceState, MigrationReport

logger = logging.getLogger(__name__)

MIGRATION_METHODS = ("kv", "tokens")  # migration.MigrationMethod's values
DRAIN_MIGRATION_RETRY_S = 0.2  # a draining instance with requests left tries to move them this often


class RequestMover:
    """Live migration as the controller drives it (see the module docstring). Runs on the
    controller's event loop and reads its live `instances` and `nodes`."""

    def __init__(self, config: ControllerConfig, cluster: ClusterClient, instances: InstanceManager,
                 nodes: Mapping[str, ClusterNode], *, context: ControlContext,
                 is_closed: Callable[[], bool]) -> None:
        self.config = config
        self._cluster = cluster
        self._instances = instances
        self._nodes = nodes
        self._record = context.record
        self._wall_clock = context.wall_clock
        self._is_closed = is_closed
        self._background = context.background  # the controller's, cancelled at its shutdown
        self._wake = context.wake

    def drain_node(self, node_id: str, migrate: bool = True) -> dict[str, Any]:
        """`Controller.drain_node` (its docstring says what a drain does)."""
        node = self._nodes.get(node_id)
        if node is None:
            raise LookupError(f"no node {node_id!r}; nodes: {sorted(self._nodes)}")
        node.draining = True
        stopping = [i for i in self._instances.all() if i.node_id == node_id and i.phase is not InstanceState.STOPPING]
        for instance in stopping:
            had_requests = instance.phase is InstanceState.READY
            self._instances.begin_stop(instance, f"node {node_id} draining", self.config.drain_timeout_s)
            if migrate and had_requests:
                task = asyncio.get_running_loop().create_task(self.move_off(instance))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        self._wake()
        return {"node_id": node_id, "stopping": sorted(i.instance_id for i in stopping),
                "migrating": migrate and any(i.handle is not None for i in stopping)}

    def undrain_node(self, node_id: str) -> dict[str, Any]:
        """Let placement use a drained node again."""
        node = self._nodes.get(node_id)
        if node is None:
            raise LookupError(f"no node {node_id!r}; nodes: {sorted(self._nodes)}")
        node.draining = False
        self._wake()
        return {"node_id": node_id, "draining": False}

    def draining_node_ids(self) -> set[str]:
        return {node_id for node_id, node in self._nodes.items() if node.draining}

    async def migrate(self, instance_id: str, request_id: str | None = None, *, to_node: str | None = None,
                      to_instance: str | None = None, method: str = "kv") -> MigrationReport:
        """`Controller.migrate` (its docstring says what is raised when)."""
        if not isinstance(instance_id, str) or not instance_id:
            raise InvalidMigrationError("instance_id", f"must be a non-empty string, got {instance_id!r}")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidMigrationError("request_id", f"must be a non-empty string or omitted, got {request_id!r}")
        if method not in MIGRATION_METHODS:
            raise InvalidMigrationError("method", f"must be one of {', '.join(MIGRATION_METHODS)}, got {method!r}")
        if to_node is not None and to_instance is not None:
            raise InvalidMigrationError("to_node", "name a destination node or a destination instance, not both")
        source = self._instances.get(instance_id)
        if source is None:
            raise UnknownInstanceError(instance_id)
        if to_node is not None and to_node not in self._nodes:
            raise LookupError(f"no node {to_node!r}; nodes: {sorted(self._nodes)}")
        if source.phase is InstanceState.LOADING or source.handle is None:
            raise MigrationConflictError(f"instance {instance_id} is still loading: it has no request to migrate")
        return await self._migrate_off(source, [request_id] if request_id is not None else None,
                                       to_node=to_node, to_instance=to_instance, method=method)

    async def _migrate_off(self, source: ManagedInstance, request_ids: list[str] | None, *, to_node: str | None = None,
                           to_instance: str | None = None, method: str = "kv") -> MigrationReport:
        """Moves the requests (None: all of them) off `source`; see `migrate`."""
        dest, why = choose_destination(source, self._instances.all(), self.draining_node_ids(), to_node=to_node,
                                       to_instance=to_instance)
        if dest is None:
            raise MigrationConflictError(f"cannot migrate off instance {source.instance_id}: {why}")
        if request_ids is None:
            request_ids = await self._cluster.worker_request_ids(source.handle, self.config.report_timeout_s)
        outcomes = []
        if request_ids:
            outcomes = await self._cluster.migrate_requests(
                source.handle, source.instance_id, dest.handle, dest.instance_id, request_ids, method,
                self.config.migration_timeout_s)
        report = MigrationReport(source_id=source.instance_id, destination_id=dest.instance_id,
                                 node_id=dest.node_id, method=method, outcomes=tuple(outcomes))
        decision = {"kind": "migration", "at_s": self._wall_clock(), "model_id": source.model_id,
                    "source": source.instance_id, "destination": dest.instance_id, "method": method,
                    "num_requests": len(outcomes), "num_migrated": report.num_migrated,
                    "stop_s_max": report.stop_s_max}
        self._record(decision)
        logger.info("%s: migrated %d/%d requests from %s to %s (%s)", source.model_id, decision["num_migrated"],
                    len(outcomes), source.instance_id, dest.instance_id, method)
        return report

    async def move_off(self, instance: ManagedInstance) -> None:
        """A draining instance's requests, moved as soon as a destination is ready, until none is
        left or the drain's deadline: a request that could not move this round (or that arrived
        from a gateway's stale table) is tried again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        while loop.time() < deadline and not self._is_closed():
            try:
                request_ids = await self._cluster.worker_request_ids(instance.handle, self.config.report_timeout_s)
                if not request_ids:
                    return
                await self._migrate_off(instance, request_ids)
            except ActorGoneError:
                return
            except MigrationConflictError as exc:  # no destination yet: the autoscaler is starting one
                logger.info("drain: %s", exc)
            except Exception:  # noqa: BLE001 - keep trying until the deadline; the stop follows anyway
                logger.exception("drain: migrating off %s failed", instance.instance_id)
            await asyncio.sleep(DRAIN_MIGRATION_RETRY_S)  # a retry pace, not a synchronisation
