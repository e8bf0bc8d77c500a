"""The simulated hardware a `SimCluster` is built from (`sim.sim_cluster` says what each part models)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from controller.read_path import check_short_fetch_ratio

__all__ = ["ClusterSpec"]

GIB = 1 << 30


def _count(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"ClusterSpec.{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """The simulated hardware.

    Fields:
        num_nodes / gpus_per_node: the cluster's shape (one slot per GPU, or a slot host per GPU
            with `models_per_gpu` above 1).
        dram_bytes_per_node / ssd_bytes_per_node: each node's checkpoint cache budgets (0: none).
        max_batch: requests one instance serves at once (vLLM's max_num_seqs, scaled down to
            what a KV cache of a few GB holds for the traces' prompt lengths).
        start_overhead_s: fixed cost of a start beyond the weight read (engine build, CUDA graphs);
            on a pre-started worker when the node keeps spares.
        stream_serve_fraction: share of a peer stream's time after which the new instance serves.
        spare_workers_per_node / process_start_s / spare_warm_s / settle_s / promote_on_settle:
            the nodes' spare workers and DRAM promotion (`sim.node_upkeep`): a start with no warm
            spare costs `process_start_s` more. The defaults (no spares, no cost for a process,
            DRAM copied at once) are the cluster-scale model's.
        request_overhead_s: latency each first token carries beyond the instance (client and
            gateway), added to every TTFT.
        stop_s / recycle_s: how long a stopped instance holds its slot after its last request
            (its worker being stopped; `recycle_s` when its worker goes back to the spare pool
            instead). 0: the slot is free at once (the cluster-scale model).
        queue_timeout_s: a request no instance has taken this long after it arrived fails, as
            the gateway fails it after the model spec's ``queue_timeout_s`` (it leaves the queue
            and is never served). None: requests wait as long as it takes (the cluster-scale
            model, whose figures count a late first token as a miss instead).
        models_per_gpu: 1: a GPU is a slot and holds one instance. Above 1: each GPU is a slot
            host (`sim.sim_host`) holding up to that many instances at once, as far as their
            shares fit `gpu_memory_bytes`, their decode steps taking turns.
        gpu_memory_bytes: what a slot host's instances share of its GPU's memory (required with
            `models_per_gpu` above 1).
        kv_pool_tokens: each instance's KV pool on a slot host, in tokens (the default: 64
            sequences of 512).
        sleep_bytes_per_gpu: the pinned host memory per GPU that a node's sleepers may hold (their
            weights; None: `gpu_memory_bytes`, the controller's default for
            ``gpu_sleep_memory_bytes``).
        concurrent_loads: a node's loads from its SSD and the repository in flight at once,
            sharing its read path evenly, the rest waiting in arrival order (`sim.node_loader`).
            1: one at a time, as the node store fetches (``NodeStoreConfig.max_concurrent_fetches``).
        short_fetch_ratio: one load at a time, a load this many times shorter than another goes
            ahead of it, pausing it if it is in flight (the default, 8, as the node store fetches,
            ``NodeStoreConfig.short_fetch_ratio``: measured best, issue 39); 0: strict arrival
            order. Not used where loads share the path.
    """

    num_nodes: int
    gpus_per_node: int
    dram_bytes_per_node: int = 512 * GIB
    ssd_bytes_per_node: int = 4096 * GIB
    max_batch: int = 64
    start_overhead_s: float = 0.0
    stream_serve_fraction: float = 0.5
    spare_workers_per_node: int = 0
    process_start_s: float = 0.0
    spare_warm_s: float = 0.0
    settle_s: float = 0.0
    promote_on_settle: bool = False
    request_overhead_s: float = 0.0
    stop_s: float = 0.0
    recycle_s: float = 0.0
    queue_timeout_s: float | None = None
    models_per_gpu: int = 1
    gpu_memory_bytes: int | None = None
    kv_pool_tokens: int = 64 * 512
    sleep_bytes_per_gpu: int | None = None
    concurrent_loads: int = 1
    short_fetch_ratio: float = 8.0

    @property
    def slot_hosts(self) -> bool:
        return self.models_per_gpu > 1

    @property
    def sleep_capacity_per_gpu(self) -> int:
        return self.sleep_bytes_per_gpu if self.sleep_bytes_per_gpu is not None else (self.gpu_memory_bytes or 0)

    def __post_init__(self) -> None:
        _count("num_nodes", self.num_nodes, 1)
        _count("gpus_per_node", self.gpus_per_node, 1)
        _count("dram_bytes_per_node", self.dram_bytes_per_node, 0)
        _count("ssd_bytes_per_node", self.ssd_bytes_per_node, 0)
        _count("max_batch", self.max_batch, 1)
        if not isinstance(self.start_overhead_s, (int, float)) or not math.isfinite(self.start_overhead_s) \
                or self.start_overhead_s < 0:
            raise ValueError(f"ClusterSpec.start_overhead_s must be a finite number >= 0, got {self.start_overhead_s!r}")
        if not isinstance(self.stream_serve_fraction, (int, float)) or not 0 < self.stream_serve_fraction <= 1:
            raise ValueError(f"ClusterSpec.stream_serve_fraction must be in (0, 1], got {self.stream_serve_fraction!r}")
        _count("spare_workers_per_node", self.spare_workers_per_node, 0)
        for name in ("process_start_s", "spare_warm_s", "settle_s", "request_overhead_s", "stop_s", "recycle_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"ClusterSpec.{name} must be a finite number >= 0, got {value!r}")
        if self.queue_timeout_s is not None and (isinstance(self.queue_timeout_s, bool)
                                                 or not isinstance(self.queue_timeout_s, (int, float))
                                                 or not math.isfinite(self.queue_timeout_s)
                                                 or self.queue_timeout_s <= 0):
            raise ValueError(f"ClusterSpec.queue_timeout_s must be a finite number > 0 or None, "
                             f"got {self.queue_timeout_s!r}")
        if not isinstance(self.promote_on_settle, bool):
            raise ValueError(f"ClusterSpec.promote_on_settle must be True or False, got {self.promote_on_settle!r}")
        _count("models_per_gpu", self.models_per_gpu, 1)
        _count("kv_pool_tokens", self.kv_pool_tokens, 1)
        _count("concurrent_loads", self.concurrent_loads, 1)
        check_short_fetch_ratio(self.short_fetch_ratio, "ClusterSpec.short_fetch_ratio")
        if self.sleep_bytes_per_gpu is not None:
            _count("sleep_bytes_per_gpu", self.sleep_bytes_per_gpu, 0)
        if self.gpu_memory_bytes is not None:
            _count("gpu_memory_bytes", self.gpu_memory_bytes, 1)
        elif self.slot_hosts:
            raise ValueError(f"ClusterSpec.models_per_gpu {self.models_per_gpu} shares each GPU's memory between "
                             f"models: give gpu_memory_bytes (what one GPU's instances may take)")
