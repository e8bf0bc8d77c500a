"""The node store as a Ray actor: one per node, called by the controller.

The controller (through its `ClusterClient`) pins a checkpoint in a tier before a worker starts
on the node (``pin``), copies one into DRAM after a start (``ensure``), unpins what no instance
uses, drops stale copies (``invalidate``) and reads ``report()`` every tick. Workers never call
the store: they load the directory the controller hands them, which the pin keeps in place.

The actor builds its `NodeStore` and repository from configs inside its own process (a boto3
client cannot be pickled) and exposes the store's API with plain values (paths as strings,
reports as frozen dataclasses). It runs threaded (`max_concurrency`), so concurrent requests
for one model reach the store together and share one fetch, and a long fetch never blocks
`report()`. This class is the only thing that knows about Ray; tests of the store itself use
`NodeStore` directly.

A load by a caller that holds no pin (a tool, a test) across the actor boundary::

    path = ray.get(store.acquire.remote(model, "dram"))
    try:
        ... load from path ...
    except (ChecksumMismatchError, TruncatedCheckpointError):
        ray.get(store.release.remote(model, "dram", corrupt=True)); raise
    else:
        ray.get(store.release.remote(model, "dram"))

Stop it with `stop_node_store` (closes the store, which frees its shared memory, then kills
the actor); if the actor is killed outright, the next store of the platform on the node reclaims
the memory.
"""

from __future__ import annotations

import os

from storage.node_settings import NodeSettings
from storage.node_store import NodeStore
from storage.repository_config import RepositoryConfig, open_repository
from storage.store_config import NodeStoreConfig
from storage.store_report import NodeStoreReport

DEFAULT_MAX_CONCURRENCY = 16


class NodeStoreActor:
    """Ray actor body over `NodeStore` (see the module docstring)."""

    def __init__(self, config: NodeStoreConfig, repository_config: RepositoryConfig):
        # The node's own settings (`thaw join --ssd-dir ...`) come with its Ray processes' environment.
        self._store = NodeStore(NodeSettings.from_env(os.environ).apply(config), open_repository(repository_config))

    def ensure(self, model: str, tier: str = "ssd") -> str:
        return str(self._store.ensure(model, tier))

    def acquire(self, model: str, tier: str = "ssd") -> str:
        return str(self._store.acquire(model, tier))

    def release(self, model: str, tier: str = "ssd", corrupt: bool = False) -> None:
        self._store.release(model, tier, corrupt=corrupt)

    def pin(self, model: str, tier: str = "ssd") -> str:
        return str(self._store.pin(model, tier))

    def unpin(self, model: str, tier: str = "ssd") -> bool:
        return self._store.unpin(model, tier)

    def evict(self, model: str, tier: str = "ssd") -> bool:
        return self._store.evict(model, tier)

    def invalidate(self, model: str, tier: str = "ssd") -> bool:
        return self._store.invalidate(model, tier)

    def report(self) -> NodeStoreReport:
        return self._store.report()

    def close(self) -> None:
        self._store.close()


def start_node_store(config: NodeStoreConfig, repository_config: RepositoryConfig, *, name: str | None = None,
                     max_concurrency: int = DEFAULT_MAX_CONCURRENCY, **options):
    """Start a `NodeStoreActor`; `options` go to ``.options()`` (e.g. a node-affinity scheduling
    strategy, a namespace). Uses no CPU slot: its work is I/O."""
    import ray  # here, not at import time: the rest of storage/ works without starting Ray

    actor_cls = ray.remote(NodeStoreActor)
    options = {"num_cpus": 0, "max_concurrency": max_concurrency, **options}
    if name is not None:
        options["name"] = name
    return actor_cls.options(**options).remote(config, repository_config)


def stop_node_store(handle, timeout_s: float = 60.0) -> None:
    """Close the store (frees its shared memory) and end the actor."""
    import ray

    try:
        ray.get(handle.close.remote(), timeout=timeout_s)
    finally:
        ray.kill(handle, no_restart=True)
