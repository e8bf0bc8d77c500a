"""How one platform's controller is set up: state, repository, node stores, worker slots, timing.

Frozen and validated on construction, no I/O (whether paths exist is the controller's business
at start). Nothing here is global: the namespace names every actor the platform starts (its
controller, node stores and workers), and the platform id -- the namespace by default -- names
its shared-memory directories, so two platforms on one Ray cluster or one machine never touch
each other's actors or memory as long as their namespaces differ.

The engine defaults are plain `worker.EngineConfig` fields; a spec's ``dtype`` and
``max_model_len`` override them per model. They are checked against `EngineConfig` here, so a
typo fails when the platform starts rather than in the first worker.

``nodes_per_ray_node`` > 1 splits every Ray node into that many logical nodes, each with its
own node store (its own SSD directory and shared-memory directory) and its own worker slots.
It exists to exercise multi-node placement with real stores on one machine (tests, demos); a
real cluster leaves it at 1.
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.slot_reclaim_policy import SlotReclaimCosts
from controller.slot_sharing_settings import SlotSharingSettings
from controller.stream_source_policy import PeerStreamSettings
from storage import NodeStoreConfig, RepositoryConfig

MIB = 1 << 20
GIB = 1 << 30
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,47}")


def _positive(name: str, value: object, *, allow_zero: bool = False) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"ControllerConfig.{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"ControllerConfig.{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def _count(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"ControllerConfig.{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """One platform's controller.

    Fields:
        state_dir: absolute directory for the platform's local state: the SQLite state store
            (unless `state_store` says otherwise) and, by default, the SSD cache.
        repository: the model repository every node store fills from; local sources are
            pushed there on deploy.
        state_store: a state store location (``redis://...``, ``sqlite:///...`` or a path);
            None: SQLite in `state_dir`.
        namespace: Ray namespace of every actor of this platform.
        platform_id: names the node stores' shared-memory directories; None: the namespace.
        ssd_dir: root of the node stores' SSD caches (one subdirectory per logical node);
            None: ``state_dir/ssd-cache``. On a cluster it is the same path on every node.
        ssd_capacity_bytes / dram_capacity_bytes: per node store; 0 DRAM: no DRAM tier.
        calibrate / calibration_bytes / repository_calibration_bytes: the node stores'
            bandwidth probes (see `storage.NodeStoreConfig`).
        cpu_worker_slots_per_node: worker slots of a logical node without GPUs; a GPU node
            has one slot per GPU (`models_per_process` per GPU where `gpu_memory_bytes` is set).
        worker_memory_bytes: each logical node's worker memory budget, shared by the instances it
            holds (each takes its weights plus its KV pool: `engine_settings.instance_memory_bytes`);
            placement packs instances by it and eviction frees it until a newcomer fits
            (ARCHITECTURE.md, "Slot hosts": memory is the slot). Slots still bound the number of
            instances; None: no budget, slots alone. CPU nodes only: a GPU node's is `gpu_memory_bytes`.
        gpu_memory_bytes: the device memory of each GPU that the models hosted on it share (weights
            plus KV pool each, as `worker_memory_bytes` on CPU). With `models_per_process` > 1 it
            makes memory the slot on GPU nodes too: each GPU gets one slot host (a warm process
            owning the GPU, its CUDA context made) holding up to `models_per_process` instances of
            models asking for at most one GPU; a sleeping one moves its weights to pinned host
            memory and holds no device memory (but keeps its place in the host). None: a GPU is
            one slot, held by one instance in a process of its own.
        gpu_sleep_memory_bytes: the pinned host memory per GPU that a GPU node's sleepers may hold
            in all (their weights); past it the longest asleep are stopped for a newcomer
            (`host_sleep_policy`). None: as much as `gpu_memory_bytes`.
        models_per_process: slot hosts (issue 38): where a node has a worker memory budget and this
            is more than 1, its warm worker processes are slot hosts (`worker.SlotHost`), each holding
            up to this many model instances that take turns at their engine steps; a new CPU
            instance is loaded into the node's host holding the fewest (a fresh process of its own
            only when none is warm with room). 1: a process per instance.
        sleep_idle_instances: where a node has a worker memory budget, a model scaling down (its
            keep-alive over) puts an idle instance to sleep rather than stopping it: its KV pool
            is freed, its weights stay in its process holding their share of the budget, and the
            model's next request wakes it without a load. Eviction takes sleepers first.
        nodes_per_ray_node: logical nodes per Ray node (see the module docstring).
        excluded_ray_node_ids: Ray nodes that get no node store and no model instance (the head
            of a cluster whose platform was started with ``thaw serve --head-only``: it runs the
            controller and the gateway, the other nodes the models).
        spare_workers_per_node: worker processes kept started, with no model, on each Ray node,
            so a cold CPU instance skips the process start and torch import (see
            `controller.spare_pool`); each costs the memory of an idle Python process with torch
            (~0.4 GB). 0 turns them off.
        spare_weight_bytes: memory each spare faults ahead for the weights of the model it will
            be given (a model up to this size loads into it; ~0.33 s saved per GB on this machine
            kind); it is resident while the spare idles. 0: none.
        spare_refill_delay_s: a node's spare is replaced only once its newest instance has been
            ready this long (a spare's start competes for the node's CPUs; see `controller.spare_pool`).
        engine_defaults: `worker.EngineConfig` fields every worker starts with.
        reconcile_interval_s: time between reconcile ticks (demand wakes one at once).
        report_timeout_s: how long a tick waits for one worker's or store's report.
        load_timeout_s: how long a worker may take from start to ready before it is replaced.
        drain_timeout_s: how long a worker being stopped may finish its open requests (or, in a
            node drain, have them migrated off).
        slot_reclaim: when a cold model would be ready soonest on a full node, free a slot there by
            migrating an instance's requests to another instance of its model and stopping it
            (see `controller.slot_reclaim_policy`), with these cost estimates; None: never.
        slot_sharing: how slots pass between models when they are contended: idle instances
            evicted for waiting models, busy ones preempted past a bounded wait, the order waiting
            models are served in (see `controller.slot_sharer`); None: a slot is only ever taken
            when free (keep-alive is a hard lease).
        peer_stream: when a model already runs, a new instance may take its weights from a
            running instance's stream instead of its node's tier, when that is estimated faster
            (see `controller.stream_source_policy`); None: always the tier.
        migration_timeout_s: how long one live migration of an instance's requests may take
            before it is abandoned (and undone: the requests stay on their source).
        queue_report_ttl_s: a gateway's queue report counts for this long; the gateway
            repeats it while requests wait.
        start_retry_delay_s: wait after a failed start before the model's next start (doubles
            per consecutive failure, up to 32x).
        fallback_*_bytes_per_s: rates placement assumes where a node store has not measured
            its own (calibration off, or not done yet).
        max_recent_decisions: scale and placement decisions kept for ``thaw status``.
    """

    state_dir: Path
    repository: RepositoryConfig
    state_store: str | None = None
    namespace: str = "thaw"
    platform_id: str | None = None
    ssd_dir: Path | None = None
    ssd_capacity_bytes: int = 64 * GIB
    dram_capacity_bytes: int = 8 * GIB
    calibrate: bool = True
    calibration_bytes: int = 64 * MIB
    repository_calibration_bytes: int = 8 * MIB
    cpu_worker_slots_per_node: int = 1
    worker_memory_bytes: int | None = None
    gpu_memory_bytes: int | None = None
    gpu_sleep_memory_bytes: int | None = None
    sleep_idle_instances: bool = True
    models_per_process: int = 1
    nodes_per_ray_node: int = 1
    excluded_ray_node_ids: tuple[str, ...] = ()
    spare_workers_per_node: int = 1
    spare_weight_bytes: int = 0
    spare_refill_delay_s: float = 5.0
    engine_defaults: Mapping[str, Any] = field(default_factory=dict)
    reconcile_interval_s: float = 1.0
    report_timeout_s: float = 5.0
    load_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0
    migration_timeout_s: float = 60.0
    slot_reclaim: SlotReclaimCosts | None = SlotReclaimCosts()
    slot_sharing: SlotSharingSettings | None = SlotSharingSettings()
    peer_stream: PeerStreamSettings | None = PeerStreamSettings()
    queue_report_ttl_s: float = 10.0
    start_retry_delay_s: float = 1.0
    fallback_dram_bytes_per_s: float = 8e9
    fallback_ssd_bytes_per_s: float = 1e9
    fallback_repository_bytes_per_s: float = 2e8
    max_recent_decisions: int = 100

    def __post_init__(self) -> None:
        for name in ("state_dir", "ssd_dir"):
            value = getattr(self, name)
            if value is None and name == "ssd_dir":
                continue
            if not isinstance(value, (str, Path)) or not str(value) or not Path(value).is_absolute():
                raise ValueError(f"ControllerConfig.{name} must be an absolute path, got {value!r}")
            object.__setattr__(self, name, Path(value))
        if not isinstance(self.repository, RepositoryConfig):
            raise ValueError(f"ControllerConfig.repository must be a storage.RepositoryConfig, "
                             f"got {type(self.repository).__name__}")
        if self.state_store is not None and (not isinstance(self.state_store, str) or not self.state_store.strip()):
            raise ValueError(f"ControllerConfig.state_store must be None or a path/URL, got {self.state_store!r}")
        for name in ("namespace", "platform_id"):
            value = getattr(self, name)
            if name == "platform_id" and value is None:
                continue
            if not isinstance(value, str) or not _NAMESPACE_RE.fullmatch(value):
                raise ValueError(f"ControllerConfig.{name} {value!r} must be 1-48 letters, digits, '_' or '-', "
                                 f"starting with a letter or digit")
        _count("ssd_capacity_bytes", self.ssd_capacity_bytes, 1)
        _count("dram_capacity_bytes", self.dram_capacity_bytes, 0)
        _count("cpu_worker_slots_per_node", self.cpu_worker_slots_per_node, 1)
        if self.worker_memory_bytes is not None:
            _count("worker_memory_bytes", self.worker_memory_bytes, 1)
        _count("nodes_per_ray_node", self.nodes_per_ray_node, 1)
        excluded = self.excluded_ray_node_ids
        if isinstance(excluded, str) or not isinstance(excluded, (tuple, list)) \
                or not all(isinstance(n, str) and n for n in excluded):
            raise ValueError(f"ControllerConfig.excluded_ray_node_ids must be a list of Ray node ids, got {excluded!r}")
        object.__setattr__(self, "excluded_ray_node_ids", tuple(excluded))
        _count("spare_workers_per_node", self.spare_workers_per_node, 0)
        _count("spare_weight_bytes", self.spare_weight_bytes, 0)
        _count("models_per_process", self.models_per_process, 1)
        if self.gpu_sleep_memory_bytes is not None:
            _count("gpu_sleep_memory_bytes", self.gpu_sleep_memory_bytes, 0)
        if self.gpu_memory_bytes is not None:
            _count("gpu_memory_bytes", self.gpu_memory_bytes, 1)
            if self.models_per_process < 2:
                raise ValueError(
                    f"ControllerConfig.gpu_memory_bytes shares a GPU's memory among the models of its slot host, "
                    f"so it needs models_per_process >= 2 (thaw serve --models-per-process N), got "
                    f"{self.models_per_process}")
        _count("max_recent_decisions", self.max_recent_decisions, 1)
        if not isinstance(self.calibrate, bool):
            raise ValueError("ControllerConfig.calibrate must be True or False")
        if not isinstance(self.sleep_idle_instances, bool):
            raise ValueError("ControllerConfig.sleep_idle_instances must be True or False")
        for name in ("reconcile_interval_s", "report_timeout_s", "load_timeout_s", "queue_report_ttl_s",
                     "migration_timeout_s",
                     "fallback_dram_bytes_per_s", "fallback_ssd_bytes_per_s", "fallback_repository_bytes_per_s"):
            object.__setattr__(self, name, _positive(name, getattr(self, name)))
        for name in ("drain_timeout_s", "start_retry_delay_s", "spare_refill_delay_s"):
            object.__setattr__(self, name, _positive(name, getattr(self, name), allow_zero=True))
        if self.slot_reclaim is not None and not isinstance(self.slot_reclaim, SlotReclaimCosts):
            raise ValueError(f"ControllerConfig.slot_reclaim must be a SlotReclaimCosts or None, "
                             f"got {type(self.slot_reclaim).__name__}")
        if self.slot_sharing is not None and not isinstance(self.slot_sharing, SlotSharingSettings):
            raise ValueError(f"ControllerConfig.slot_sharing must be a SlotSharingSettings or None, "
                             f"got {type(self.slot_sharing).__name__}")
        if self.peer_stream is not None and not isinstance(self.peer_stream, PeerStreamSettings):
            raise ValueError(f"ControllerConfig.peer_stream must be a PeerStreamSettings or None, "
                             f"got {type(self.peer_stream).__name__}")
        if not isinstance(self.engine_defaults, Mapping):
            raise ValueError(f"ControllerConfig.engine_defaults must be a mapping of EngineConfig fields, "
                             f"got {type(self.engine_defaults).__name__}")
        # A copy, so the caller's dict changing later does not change this config (a mapping proxy
        # would be safer still, but cannot be pickled to the controller actor).
        object.__setattr__(self, "engine_defaults", dict(self.engine_defaults))
        self.engine_config()  # a bad field fails here, naming itself
        self.node_store_config("check")  # calibration sizes, capacities and ids checked by the store's config

    @property
    def effective_platform_id(self) -> str:
        return self.platform_id if self.platform_id is not None else self.namespace

    @property
    def effective_ssd_dir(self) -> Path:
        return self.ssd_dir if self.ssd_dir is not None else self.state_dir / "ssd-cache"

    @property
    def state_location(self) -> str:
        """Where the state store is: the configured URL/path, or the state directory (SQLite)."""
        return self.state_store if self.state_store is not None else str(self.state_dir) + "/"

    @property
    def hosts_gpu_models(self) -> bool:
        """Whether GPU nodes share each GPU among the models of its slot host (`gpu_memory_bytes`)."""
        return self.gpu_memory_bytes is not None

    @property
    def sleep_host_bytes_per_gpu(self) -> int:
        """The host memory per GPU its sleepers may hold (`gpu_sleep_memory_bytes`, else the GPU's budget)."""
        if self.gpu_sleep_memory_bytes is not None:
            return self.gpu_sleep_memory_bytes
        return self.gpu_memory_bytes or 0

    @property
    def slots_per_gpu(self) -> int:
        """A GPU node's slots per GPU: the models its slot host may hold, else 1 (the GPU is the slot)."""
        return self.models_per_process if self.hosts_gpu_models else 1

    @functools.cached_property
    def default_kv_cache_bytes(self) -> int:
        """The KV pool size of the engine defaults, built once (placement prices every start with
        it, and building an `EngineConfig` validates every field)."""
        return self.engine_config().kv_cache_bytes

    @property
    def spare_kv_bytes(self) -> int:
        """Memory each spare faults ahead for its KV pool: the workers' KV cache size (0 when the
        engine defaults fix a block count instead, whose size depends on the model)."""
        if self.spare_workers_per_node == 0:
            return 0
        return 0 if self.engine_config().num_kv_blocks is not None else self.default_kv_cache_bytes

    def engine_config(self, overrides: Mapping[str, Any] | None = None):
        """The `worker.EngineConfig` of a worker: the defaults with `overrides` on top.

        Imported here: the worker package brings torch, which code that only reads this
        config (a CLI, the gateway) does not need."""
        from worker import EngineConfig

        values = {**self.engine_defaults, **(overrides or {})}
        try:
            return EngineConfig(**values)
        except TypeError as exc:  # an unknown field
            raise ValueError(f"ControllerConfig.engine_defaults: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"ControllerConfig.engine_defaults: {exc}") from None

    def node_store_config(self, node_id: str) -> NodeStoreConfig:
        """The store config of one logical node: its own SSD subdirectory, this platform's id."""
        return NodeStoreConfig(
            ssd_dir=self.effective_ssd_dir / node_id,
            ssd_capacity_bytes=self.ssd_capacity_bytes,
            dram_capacity_bytes=self.dram_capacity_bytes,
            platform_id=self.effective_platform_id,
            node_id=node_id,
            calibrate=self.calibrate,
            calibration_bytes=self.calibration_bytes,
            repository_calibration_bytes=self.repository_calibration_bytes,
        )
