"""The nodes the controller places on, and how one becomes a `NodeView` for the placement policy.

A logical node is one node store plus a number of worker slots on one Ray node. Normally there
is one per Ray node; `ControllerConfig.nodes_per_ray_node` splits a Ray node into several (each
with its own store, so its own SSD and DRAM holdings) to exercise placement on one machine.

Everything here except `ClusterNode` itself is a pure function of reports and instances, so
the controller's view of a node is tested with plain values:

- `plan_nodes`: which logical nodes the live Ray nodes give, with their slot counts;
- `node_view`: the placement input for one model on one node -- tiers holding it, calibrated
  rates (the config's fallbacks where the store has not measured), free slots and worker
  memory, loader wait;
- `store_tier`: which tier the node store should bring the model into before a worker reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from controller.controller_config import ControllerConfig
from controller.managed_instance import ManagedInstance
from controller.placement_policy import NodeView, TierBandwidths
from storage import BandwidthReport, NodeStoreReport
from wire import InstanceState

NODE_ID_PREFIX_CHARS = 16  # of the Ray node id (56 hex digits); 64 bits keeps them apart


@dataclass(frozen=True)
class RayNodeInfo:
    """A live Ray node: its id, its GPU count (0 on a CPU-only node) and their kind as Ray names it
    (its ``accelerator_type:<kind>`` resource, e.g. "H200"; None when Ray names none)."""

    ray_node_id: str
    num_gpus: int = 0
    accelerator: str | None = None


@dataclass(frozen=True)
class PlannedNode:
    """A logical node `plan_nodes` derives from a live Ray node."""

    node_id: str
    ray_node_id: str
    num_slots: int
    num_gpus: int = 0
    accelerator: str | None = None


@dataclass
class ClusterNode:
    """One logical node: its store's actor handle and last report, its slots, whether it drains.

    `report` is the last report that arrived; a tick whose report times out keeps it (holdings
    change slowly, and placement without it would assume an empty node)."""

    node_id: str
    ray_node_id: str
    num_slots: int
    num_gpus: int = 0  # its Ray node's GPUs (0: a CPU node, whose slots are configured)
    accelerator: str | None = None
    store: Any = None
    report: NodeStoreReport | None = None
    report_error: str | None = None
    draining: bool = False


def plan_nodes(ray_nodes: Iterable[RayNodeInfo], nodes_per_ray_node: int, cpu_worker_slots_per_node: int,
               excluded_ray_node_ids: Iterable[str] = (), slots_per_gpu: int = 1) -> list[PlannedNode]:
    """The logical nodes of every live Ray node not excluded, sorted by id: `slots_per_gpu` slots
    per GPU on a GPU node (1: the GPU is the slot; more where each GPU's slot host holds that many
    models, `ControllerConfig.slots_per_gpu`), `cpu_worker_slots_per_node` on a CPU node.

    Logical ids are a prefix of the Ray id (node-store ids must be short: they name
    shared-memory directories), suffixed ``-0``, ``-1``... when a Ray node is split."""
    excluded = set(excluded_ray_node_ids)
    planned = []
    for node in ray_nodes:
        if node.ray_node_id in excluded:
            continue
        slots = node.num_gpus * slots_per_gpu if node.num_gpus > 0 else cpu_worker_slots_per_node
        prefix = node.ray_node_id[:NODE_ID_PREFIX_CHARS]
        ids = [prefix] if nodes_per_ray_node == 1 else [f"{prefix[:12]}-{i}" for i in range(nodes_per_ray_node)]
        planned += [PlannedNode(node_id, node.ray_node_id, slots, node.num_gpus, node.accelerator) for node_id in ids]
    return sorted(planned, key=lambda planned_node: planned_node.node_id)


def gpus_text(num_gpus: float) -> str:
    """``"1 GPU"``, ``"8 GPUs"``, ``"0.5 GPUs"``: a GPU count in a message."""
    return f"{num_gpus:g} GPU{'s' * (num_gpus != 1)}"


def node_kind_text(num_gpus: int, accelerator: str | None) -> str:
    """A node's kind in a log line: ``"CPU"``, ``"1 GPU (H200)"``."""
    if not num_gpus:
        return "CPU"
    return f"{gpus_text(num_gpus)} ({accelerator})" if accelerator else gpus_text(num_gpus)


def kind_refusal(num_gpus: float, node: ClusterNode) -> str | None:
    """Why an instance asking for `num_gpus` GPUs (a spec's ``resources.num_gpus``) can never run
    on `node`, or None when it can. A GPU model needs a node with at least that many GPUs; a CPU
    model (0) a CPU node, since a GPU node's slots are its GPUs (a CPU instance there would hold a
    GPU it never uses)."""
    if num_gpus > 0 and node.num_gpus == 0:
        return "a CPU node"
    if num_gpus > node.num_gpus:
        return gpus_text(node.num_gpus)
    if num_gpus == 0 and node.num_gpus > 0:
        return "a GPU node"
    return None


def nodes_of_kind(num_gpus: float, nodes: Iterable[ClusterNode]) -> tuple[list[ClusterNode], str | None]:
    """The nodes an instance asking for `num_gpus` GPUs can run on (`kind_refusal`), and when
    there are nodes but none of them fits, why (a placement refusal in the user's terms)."""
    nodes = list(nodes)
    fitting = [node for node in nodes if kind_refusal(num_gpus, node) is None]
    if fitting or not nodes:
        return fitting, None
    kinds = sorted({kind_refusal(num_gpus, node) or "" for node in nodes})
    if num_gpus > 0:
        return [], (f"no node with {gpus_text(num_gpus)}: the model asks for {num_gpus:g} per "
                    f"instance (resources.num_gpus) and the {len(nodes)} connected node(s) are {', '.join(kinds)}")
    return [], (f"no CPU node: the model runs on CPU (resources.num_gpus 0) and each of the {len(nodes)} connected "
                f"node(s) is a GPU node, whose slots are its GPUs; deploy it with num_gpus > 0 or add a CPU node")


def effective_bandwidth(report: NodeStoreReport | None, config: ControllerConfig) -> BandwidthReport:
    """The node's measured rates, with the config's fallbacks where nothing was measured."""
    measured = report.bandwidth if report is not None else BandwidthReport(None, None, None, measured_at=0.0)
    return dataclasses.replace(
        measured,
        dram_bytes_per_s=measured.dram_bytes_per_s or config.fallback_dram_bytes_per_s,
        ssd_bytes_per_s=measured.ssd_bytes_per_s or config.fallback_ssd_bytes_per_s,
        repository_bytes_per_s=measured.repository_bytes_per_s or config.fallback_repository_bytes_per_s,
    )


def has_dram_tier(report: NodeStoreReport | None, config: ControllerConfig) -> bool:
    if report is None:
        return config.dram_capacity_bytes > 0
    return report.tier("dram").capacity_bytes > 0


def tier_bandwidths(report: NodeStoreReport | None, config: ControllerConfig) -> TierBandwidths:
    """Placement's rates for a node: end-to-end into a worker, from each tier it has.

    The repository rate is download then SSD read (`BandwidthReport.rate`), since a fetched
    model lands on the SSD before a worker reads it."""
    rates = effective_bandwidth(report, config)
    return TierBandwidths(
        repository_bytes_per_s=rates.rate("repository"),
        ssd_bytes_per_s=rates.rate("ssd"),
        dram_bytes_per_s=rates.rate("dram") if has_dram_tier(report, config) else None,
    )


def model_tiers(report: NodeStoreReport | None, repository_name: str) -> frozenset[str]:
    """Tiers of the node holding a usable (fully arrived) copy of the model."""
    if report is None:
        return frozenset()
    return frozenset(tier.tier for tier in report.tiers
                     if tier.capacity_bytes > 0 and repository_name in tier.models)


def num_used_slots(node_id: str, instances: Iterable[ManagedInstance]) -> int:
    """Slots taken on the node; a stopping instance holds its slot until it is gone, an asleep one
    holds none (`ManagedInstance.holds_slot`)."""
    return sum(instance.num_worker_slots for instance in instances
               if instance.node_id == node_id and instance.holds_slot)


def used_memory_bytes(node_id: str, instances: Iterable[ManagedInstance]) -> int:
    """What the node's instances take of its worker memory budget; a stopping one holds its share
    until it is gone, as it does its slot; an asleep one its weights (`held_memory_bytes`)."""
    return sum(instance.held_memory_bytes for instance in instances if instance.node_id == node_id)


def worker_memory_budget(node: ClusterNode, config: ControllerConfig) -> int | None:
    """The memory the node's instances share: its own budget (``thaw join --worker-memory-gb``, which
    its store reports), else the platform's (`ControllerConfig.worker_memory_bytes`); None: slots
    alone bound it. A GPU node's instances live in device memory, which a host-RAM budget does not
    describe: its budget is its GPUs' (`ControllerConfig.gpu_memory_bytes` each), None without one
    (its slots are its GPUs). An instance still lives on one GPU: `gpu_memory_bytes` is what one
    GPU's slot host can hold (`SparePool.host_for` fits it into one)."""
    if node.num_gpus:
        return None if config.gpu_memory_bytes is None else config.gpu_memory_bytes * node.num_gpus
    own = node.report.worker_memory_bytes if node.report is not None else None
    return own if own is not None else config.worker_memory_bytes


def has_worker_memory_budget(node: ClusterNode, config: ControllerConfig) -> bool:
    """Whether the node's instances share a worker memory budget (`worker_memory_budget`)."""
    return worker_memory_budget(node, config) is not None


def free_memory_bytes(node: ClusterNode, instances: Iterable[ManagedInstance], config: ControllerConfig) -> int | None:
    """What the node's worker memory budget has left (None: no budget; 0 on a draining node)."""
    budget = worker_memory_budget(node, config)
    if budget is None:
        return None
    if node.draining:
        return 0
    return max(0, budget - used_memory_bytes(node.node_id, instances))


def loader_loads_s(node_id: str, instances: Iterable[ManagedInstance], now: float) -> tuple[float, ...]:
    """What each of the node's loads in progress from its disk or the repository has left by its
    estimate, in the order they started: a new read from there waits for those it does not pass
    (`NodeView.loader_loads_s`, `controller.read_path`). A load from the DRAM tier does not hold
    that path up."""
    return tuple(instance.remaining_load_s(now) for instance in sorted(
        (i for i in instances if i.node_id == node_id and i.phase is InstanceState.LOADING and i.tier != "dram"),
        key=lambda i: i.started_s))


def node_view(node: ClusterNode, repository_name: str, instances: list[ManagedInstance],
              config: ControllerConfig, now: float) -> NodeView:
    """The placement policy's input for putting `repository_name` on `node`."""
    free = 0 if node.draining else max(0, node.num_slots - num_used_slots(node.node_id, instances))
    return NodeView(
        node_id=node.node_id,
        num_free_slots=free,
        bandwidths=tier_bandwidths(node.report, config),
        model_tiers=model_tiers(node.report, repository_name),
        loader_loads_s=tuple(left for left in loader_loads_s(node.node_id, instances, now) if left > 0),
        short_fetch_ratio=node.report.short_fetch_ratio if node.report is not None else 0.0,
        free_memory_bytes=free_memory_bytes(node, instances, config),
    )


def store_tier(report: NodeStoreReport | None, repository_name: str, config: ControllerConfig) -> str:
    """The tier a new instance reads from: DRAM when the model is there already, else SSD (the
    store fetches it there first if needed). Copying SSD -> DRAM before the load would put a
    second full read and write on the cold start's path (measured: ~1.5 s for 1 GB, against a
    ~0.8 s direct read); `dram_can_take` decides the promotion after the instance is serving."""
    if not has_dram_tier(report, config) or report is None:
        return "ssd"
    return "dram" if repository_name in report.tier("dram").models else "ssd"


def dram_can_take(report: NodeStoreReport | None, repository_name: str, model_bytes: int,
                  config: ControllerConfig) -> bool:
    """Whether the node's DRAM tier should take a copy of the model (so its next start there is
    fast): it is not there yet and fits beside what DRAM cannot give up (pinned, loading or
    arriving entries); forcing it in would only fail or evict a busy neighbour."""
    if not has_dram_tier(report, config) or report is None:
        return False
    dram = report.tier("dram")
    if repository_name in dram.models:
        return False
    held = sum(entry.num_bytes for entry in dram.entries if entry.pinned or entry.loading or entry.filling)
    return dram.capacity_bytes - held >= model_bytes
