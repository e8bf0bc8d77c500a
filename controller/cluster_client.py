"""Everything the controller asks of the cluster, behind one small interface.

Every Ray call the controller makes goes through a `ClusterClient` (as Ray Serve's controller
goes through one wrapper per Ray concern), so the controller's logic -- adoption, autoscaling,
placement, the start/stop lifecycle -- is unit-tested against a fake in memory, and only
`RayClusterClient` knows about actors, names, namespaces and Ray's exception types.

Handles are opaque to the controller (`ActorHandle`): whatever the client returns from
`start_worker` or `connect_node_store` is passed back to it unchanged. What comes back from a
worker is typed by wire's records (`wire.InstanceLoad`, `wire.InstanceStats`) and migration's
own (`migration.MigrationOutcome`, ...); worker's and migration's types are named here for the
type checker only, so importing this module imports neither. A call that cannot finish in its
timeout raises `TimeoutError`; a call to an actor that no longer exists raises `ActorGoneError`
(`wire`'s, the one error every Ray caller maps an actor's death to); anything else an actor
raised on purpose (a failed load, a full tier) propagates as itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from controller.cluster_node import RayNodeInfo
from storage import NodeStoreConfig, NodeStoreReport
from wire import ActorGoneError, InstanceLoad, InstanceStats

if TYPE_CHECKING:
    from loader import StreamConfig
    from migration import MigrationOutcome, ParkedRequest
    from worker import EngineConfig, PeerWeights

__all__ = ["NODE_STORE_ACTOR_PREFIX", "WORKER_ACTOR_PREFIX", "ActorGoneError", "ActorHandle", "ClusterClient",
           "node_store_actor_name", "worker_actor_name"]

# An actor's handle: Ray's in `RayClusterClient`, a fake's in tests; the controller only passes it back.
ActorHandle = Any

WORKER_ACTOR_PREFIX = "thaw-worker-"
NODE_STORE_ACTOR_PREFIX = "thaw-node-store-"


def worker_actor_name(instance_id: str) -> str:
    """The named actor of one model instance (unique within the platform's namespace)."""
    return f"{WORKER_ACTOR_PREFIX}{instance_id}"


def node_store_actor_name(node_id: str) -> str:
    """The named actor of one logical node's store (unique within the platform's namespace)."""
    return f"{NODE_STORE_ACTOR_PREFIX}{node_id}"


class ClusterClient(ABC):
    """The cluster as the controller sees it (see the module docstring). Methods that wait are
    coroutines, run on the controller's event loop."""

    namespace: str

    @abstractmethod
    async def list_nodes(self) -> list[RayNodeInfo]:
        """The live Ray nodes."""

    # --- node stores ------------------------------------------------------------------------

    @abstractmethod
    async def connect_node_store(self, node_id: str, ray_node_id: str, config: NodeStoreConfig) -> ActorHandle:
        """The handle of the node's store: the running one found by name, else a new one
        started on that Ray node (outliving the controller, so its caches survive a restart)."""

    @abstractmethod
    async def node_store_report(self, store: ActorHandle, timeout_s: float) -> NodeStoreReport: ...

    @abstractmethod
    async def pin_checkpoint(self, store: ActorHandle, model: str, tier: str, timeout_s: float) -> str:
        """Bring `model` into `tier` (fetching or promoting on a miss), pin it there, return its
        local path. Raises `storage.TierFullError` if the tier cannot make room."""

    @abstractmethod
    async def prefetch_checkpoint(self, store: ActorHandle, model: str, tier: str, timeout_s: float) -> str:
        """Have the store bring the model into that tier, unpinned (a copy for later starts);
        returns its local path there. Raises `storage.TierFullError` when it cannot fit."""

    @abstractmethod
    async def unpin_checkpoint(self, store: ActorHandle, model: str, tier: str, timeout_s: float) -> bool: ...

    @abstractmethod
    async def invalidate_checkpoint(self, store: ActorHandle, model: str, tier: str, timeout_s: float) -> bool:
        """Drop the node's copy (the repository's content changed)."""

    @abstractmethod
    async def stop_node_store(self, store: ActorHandle, timeout_s: float) -> None:
        """Close the store (its shared memory is freed) and end its actor."""

    # --- workers ----------------------------------------------------------------------------

    @abstractmethod
    def start_worker(self, *, instance_id: str, model_id: str, model_dir: str | None, engine_config: EngineConfig,
                     actor_name: str, ray_node_id: str, num_cpus: float, num_gpus: float,
                     peer: PeerWeights | None = None, num_threads: int | None = None) -> ActorHandle:
        """Start a model-instance actor on that Ray node and return its handle at once (the
        model loads in the actor; `worker_ready` waits for it). It outlives the controller.
        `peer`: a `worker.PeerWeights` ticket: the weights come from that stream, and `model_dir`
        (None until `supply_fallback`) is only the stream's fallback. `num_threads`: the engine's
        threads where `num_cpus` (Ray's reservation) does not set them (0 reserved)."""

    @abstractmethod
    def start_spare_worker(self, *, actor_name: str, ray_node_id: str, host_models: int = 1,
                           num_gpus: int = 0) -> ActorHandle:
        """Start a spare worker (a process with the engine imported and no model) on that Ray
        node; returns its handle at once. It outlives the controller. `host_models` > 1: a slot
        host holding up to that many instances (`worker.SlotHost`; its instances are addressed as
        `wire.HostedInstance`s, and stopping one unloads it from the host); `num_gpus` 1: a slot
        host owning one GPU of its node."""

    @abstractmethod
    async def spare_warm(self, handle: ActorHandle, timeout_s: float, *, weight_bytes: int = 0,
                         kv_bytes: int = 0) -> float:
        """Warm the spare up (one-time costs paid, `weight_bytes` and `kv_bytes` of memory faulted
        for its future model) and wait until it can take a model; returns its process's age in s."""

    @abstractmethod
    async def assign_worker(self, handle: ActorHandle, *, instance_id: str, model_id: str, model_dir: str | None,
                            engine_config: EngineConfig, num_threads: int, timeout_s: float,
                            peer: PeerWeights | None = None, step_priority: int = 0) -> None:
        """Give a spare its model (or a slot host one more, `handle` the hosted instance's): it
        starts loading (`worker_ready` waits for it); `peer` as in `start_worker`;
        `step_priority` its place in a slot host's turns at stepping (`worker.serving.step_turns`)."""

    @abstractmethod
    async def stream_weights(self, handle: ActorHandle, num_receivers: int, config: StreamConfig | None,
                             timeout_s: float) -> PeerWeights:
        """Ask a running worker to stream its model to `num_receivers` new workers; returns the
        `worker.PeerWeights` ticket of rank 1. Raises `worker.SourceUnavailableError` when it cannot."""

    @abstractmethod
    async def supply_fallback(self, handle: ActorHandle, model_dir: str, timeout_s: float) -> None:
        """Tell a worker fed by a stream where its node's copy of the checkpoint is."""

    @abstractmethod
    async def find_worker(self, actor_name: str, instance_id: str | None = None) -> ActorHandle | None:
        """The handle of a running worker actor by name, None if there is none; where that actor is
        a slot host, the handle of `instance_id` in it (`wire.HostedInstance`)."""

    @abstractmethod
    async def worker_ready(self, handle: ActorHandle, timeout_s: float) -> InstanceLoad:
        """Wait for the model to be loaded; returns the worker's `InstanceLoad`."""

    @abstractmethod
    async def worker_stats(self, handle: ActorHandle, timeout_s: float) -> InstanceStats:
        """The worker's `InstanceStats` now."""

    @abstractmethod
    async def stop_worker(self, handle: ActorHandle, timeout_s: float) -> None:
        """Shut the worker down (open requests end "suspended": the gateway continues them on the
        model's next instance) and end its actor; a worker that is already gone counts as stopped."""

    @abstractmethod
    async def release_worker(self, handle: ActorHandle, timeout_s: float) -> None:
        """Shut the worker's model down and keep its process as a spare (``release_model``)."""

    @abstractmethod
    async def sleep_worker(self, handle: ActorHandle, timeout_s: float) -> int:
        """Put an idle worker's model to sleep (``sleep``: its KV pool freed, its weights kept);
        returns the bytes freed. Raises when it cannot (a request open, not ready)."""

    @abstractmethod
    async def wake_worker(self, handle: ActorHandle, timeout_s: float) -> None:
        """Wake a sleeping worker's model (``wake``): it serves again."""

    @abstractmethod
    async def worker_request_ids(self, handle: ActorHandle, timeout_s: float) -> list[str]:
        """Ids of the requests open on the worker (started there or migrated in)."""

    @abstractmethod
    async def park_requests(self, handle: ActorHandle, instance_id: str, max_bytes: int,
                            timeout_s: float) -> dict[str, ParkedRequest]:
        """Moves the worker's running requests' KV into this process's memory by KV migration
        (`migration.ParkingEndpoint`), each at most `max_bytes`; their streams end "suspended".
        Returns request id -> `migration.ParkedRequest` for those parked (the rest stay)."""

    @abstractmethod
    async def unpark_requests(self, handle: ActorHandle, instance_id: str, parked: list[ParkedRequest],
                              timeout_s: float) -> list[str]:
        """Replays parked requests into the worker (`migration.replay`): each runs there from where it
        stopped, waiting for its client's ``recover``. Returns the ids replayed; a failed one is
        left for the client to recompute from its tokens."""

    @abstractmethod
    async def suspend_requests(self, handle: ActorHandle, timeout_s: float) -> list[str]:
        """End every stream on the worker with finish reason "suspended" (the gateway queues those
        requests for their model's next instance), and every new one at once; their ids."""

    @abstractmethod
    async def migrate_requests(self, source: ActorHandle, source_instance_id: str, dest: ActorHandle,
                               dest_instance_id: str, request_ids: list[str], method: str,
                               timeout_s: float) -> list[MigrationOutcome]:
        """Live-migrates the requests from one worker to another, concurrently; one
        `migration.MigrationOutcome` per request, in order. A request that could not move keeps
        running on the source (the outcome says why); this never raises for one."""

    @abstractmethod
    async def list_worker_actor_names(self) -> list[str]:
        """Names of the live worker actors of this platform's namespace."""

    @abstractmethod
    async def kill_worker(self, actor_name: str) -> None:
        """End a worker actor found by name at once (an orphan no record accounts for)."""
