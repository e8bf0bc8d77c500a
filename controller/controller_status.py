"""Plain-data views of the controller's state, for ``thaw status``, `get_model` and logs.

Pure functions from the controller's objects to dicts of strings, numbers, lists and None, so
they pickle across Ray, print as JSON, and are tested without a cluster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from controller.autoscale_policy import ScaleDecision
from controller.cluster_node import (ClusterNode, effective_bandwidth, free_memory_bytes, has_worker_memory_budget,
                                    num_used_slots, tier_bandwidths, used_memory_bytes, worker_memory_budget)
from controller.controller_config import ControllerConfig
from controller.managed_instance import ManagedInstance
from controller.model_state import ModelState
from controller.placement_policy import PlacementDecision
from wire import InstanceState


def scale_to_dict(model_id: str, previous: int, decision: ScaleDecision, at_s: float) -> dict[str, Any]:
    return {"kind": "scale", "model_id": model_id, "from_instances": previous,
            "num_instances": decision.num_instances, "num_desired_instances": decision.num_desired_instances,
            "reason": decision.reason, "at_s": at_s}


def placement_to_dict(model_id: str, decision: PlacementDecision, at_s: float,
                      instance_id: str | None = None) -> dict[str, Any]:
    return {
        "kind": "placement", "model_id": model_id, "instance_id": instance_id, "node_id": decision.node_id,
        "tier": decision.tier, "estimate_s": decision.estimate_s, "reason": decision.reason, "at_s": at_s,
        "estimates": [
            {"node_id": e.node_id, "tier": e.tier, "load_s": e.load_s, "wait_s": e.wait_s, "ready_s": e.ready_s,
             "num_free_slots": e.num_free_slots, "free_memory_bytes": e.free_memory_bytes, "has_room": e.has_room}
            for e in decision.estimates
        ],
    }


def event_to_dict(kind: str, model_id: str, reason: str, at_s: float, instance_id: str | None = None
                  ) -> dict[str, Any]:
    """A lifecycle event: an instance ready, stopped, died, or a start that failed."""
    return {"kind": kind, "model_id": model_id, "instance_id": instance_id, "reason": reason, "at_s": at_s}


def worker_memory_to_dict(node: ClusterNode, instances: Sequence[ManagedInstance], config: ControllerConfig
                          ) -> dict[str, Any] | None:
    """The node's worker memory budget (None without one): used, free, and by whom."""
    if not has_worker_memory_budget(node, config):
        return None
    mine = [i for i in instances if i.node_id == node.node_id]
    used = used_memory_bytes(node.node_id, mine)
    return {"budget_bytes": worker_memory_budget(node, config), "used_bytes": used,
            "free_bytes": free_memory_bytes(node, mine, config),
            "instances": [{"instance_id": i.instance_id, "model_id": i.model_id, "state": i.phase.value,
                           "memory_bytes": i.held_memory_bytes} for i in mine]}


def model_to_dict(state: ModelState, instances: Sequence[ManagedInstance], now: float,
                  queue_report_ttl_s: float) -> dict[str, Any]:
    """One model's line of ``thaw status``: desired against ready and loading, its load, and the
    reasons of its last scale and placement decisions. `instances`: the model's own."""
    return {
        "model_id": state.model_id, "num_desired_instances": state.num_desired_instances,
        "num_ready_instances": sum(i.phase is InstanceState.READY for i in instances),
        "num_loading_instances": sum(i.phase is InstanceState.LOADING for i in instances),
        "num_ongoing_requests": sum(i.num_ongoing_requests for i in instances),
        "num_queued_requests": state.num_queued_requests(now, queue_report_ttl_s),
        "scale_reason": state.last_scale["reason"] if state.last_scale else None,
        "placement_reason": state.last_placement["reason"] if state.last_placement else None,
    }


def node_to_dict(node: ClusterNode, instances: Sequence[ManagedInstance], config: ControllerConfig) -> dict[str, Any]:
    """A node with its slots and worker memory, its tiers' entries (least recently used first) and
    its rates: measured by its store, and the ones placement uses (fallbacks filled in).
    `instances`: every instance the controller runs (the node's are picked out)."""
    report = node.report
    tiers = []
    measured = None
    if report is not None:
        measured = dataclasses.asdict(report.bandwidth)
        tiers = [
            {"tier": tier.tier, "capacity_bytes": tier.capacity_bytes, "used_bytes": tier.used_bytes,
             "entries": [dataclasses.asdict(entry) for entry in tier.entries]}
            for tier in report.tiers
        ]
    used = dataclasses.asdict(tier_bandwidths(report, config))
    return {
        "node_id": node.node_id, "ray_node_id": node.ray_node_id, "num_slots": node.num_slots,
        "num_gpus": node.num_gpus, "accelerator": node.accelerator,
        "num_free_slots": max(0, node.num_slots - num_used_slots(node.node_id, instances)),
        "worker_memory": worker_memory_to_dict(node, instances, config), "draining": node.draining,
        "store_connected": node.store is not None, "report_error": node.report_error,
        "reported_at": report.reported_at if report is not None else None,
        "num_fetches": report.num_fetches if report is not None else 0,
        "num_fetches_waiting": report.num_fetches_waiting if report is not None else 0,
        "tiers": tiers, "measured_bandwidth": measured,
        "effective_bandwidth": dataclasses.asdict(effective_bandwidth(report, config)),
        "placement_bytes_per_s": used,
    }


def hosts_to_dict(hosts: Sequence[Any], instances: Sequence[ManagedInstance]) -> list[dict[str, Any]]:
    """Each slot host (`SparePool.hosts`): where it runs, whether it is warm, the instances it holds
    with their state, and the worker memory they hold (asleep ones their weights alone)."""
    by_id = {i.instance_id: i for i in instances}
    rows = []
    for host in hosts:
        held = [by_id[i] for i in sorted(host.hosted) if i in by_id]
        rows.append({"actor_name": host.actor_name, "ray_node_id": host.ray_node_id, "warm": host.warm,
                     "instances": [{"instance_id": i.instance_id, "model_id": i.model_id, "state": i.phase.value,
                                    "memory_bytes": i.held_memory_bytes,
                                    "num_generated_tokens": i.num_generated_tokens} for i in held],
                     "memory_bytes": sum(i.held_memory_bytes for i in held)})
    return rows
