"""The controller: model registry, autoscaling and placement policies, durable state.

Public API (everything else in this folder is private to it):
- `ModelSpec`, `ResourceSpec`, `AutoscalingPolicy`, `SpecError`: what a deployed model is,
  validated; `load_model_spec(s)` read YAML/JSON files, `add_model_spec_arguments` /
  `model_spec_from_arguments` build one from command-line flags; `parse_model_id`.
- `decide`, `LoadSnapshot`, `AutoscaleState`, `ScaleDecision`: the autoscaling policy, a pure
  function of a load snapshot and its explicit state.
- `place`, `place_locality_blind`, `NodeView`, `TierBandwidths`, `PlacementDecision`,
  `NodeEstimate`: locality-aware placement (and the baseline it is measured against).
- `open_state_store`, `StateStore`, `StateStoreError`, `WorkerRecord`, `ApiKeyRecord`:
  specs, tenants, hashed API keys, desired counts and the worker registry, in SQLite or Redis;
  `new_api_key`: a key in the platform's form, made outside any store (to import).
- `Controller`, `ControllerConfig`: the registry and reconcile loop (a plain class over a
  `ClusterClient`, the interface it drives nodes, stores and workers through, whose calls raise
  `ActorGoneError` for an actor that is gone; `RayClusterClient` is the real one, and tests
  implement a fake; `RayNodeInfo`: a live node as it lists them, `NODE_ID_PREFIX_CHARS`: how much of
  a Ray node id names its logical node); `ControllerActor`,
  `start_controller`, `get_controller`, `stop_controller`, `DEFAULT_CONTROLLER_NAME`: the same
  as a detached, named Ray actor; `GatewayMetricsBoard`: the gateway replicas' per-request
  metrics that actor relays between them.
- `RoutingTable`, `Route`: the versioned model -> ready instances table the gateway routes from.
- `SlotOutlook`, `SlotHolder`: what a model waiting for an instance is told (the answer to a
  gateway's queue report); `SlotSharingSettings`: how slots pass between models on demand.
- `TenantQuota`, `instances_over_quota`, `queued_over_quota`: a tenant's limits (max instances,
  max queued requests) and the pure checks the controller and the gateway enforce them with.
- `ControllerError`, `InvalidSpecError`, `UnknownModelError`, `UnknownTenantError`, `ModelAlreadyDeployedError`,
  `DeployConflictError` (another deploy of the name is in flight), `InvalidMigrationError`,
  `UnknownInstanceError`, `MigrationConflictError`, `UnknownDeployError`, `UnknownUploadError`,
  `InvalidUploadError`, `UploadOffsetError`: what the controller's API refuses with (they
  pickle across Ray with their fields).
- `choose_destination`: where ``migrate`` and a drain send an instance's requests (pure policy).
- `repository_name`, `worker_actor_name`, `node_store_actor_name`: how models and actors are named.
- For the simulator (`sim/`), the rest of the policy layer it calls unchanged: `desired_instances`, `keep_alive_for`,
  `choose_eviction`/`EvictionCandidate`, `choose_preemption`/`PreemptionCandidate`,
  `order_waiting`/`WaitingModel`, `choose_load_path`/`PeerStreamSettings`, `ManagedInstance`
  (their input, its phase a `wire.InstanceState`), `UsageMeter` (the eviction score's frequency);
  `plan_model`, `ModelView`, `InstanceView`, `ModelPlan`: the one planner of a model's tick (its
  count, which instances scale down, which sleepers wake, how many to place), which the
  controller and the simulator both carry out; `SlotHold`, `views_past_holds`: slots held for a
  waiting model, and the one rule placement sees a node past them by.

The controller itself, its config and its Ray side are imported on first use (PEP 562
`__getattr__`): they bring the storage and worker packages (boto3, torch), which code that only
validates specs or reads the routing table (the gateway, the CLI) does not need.
"""

import importlib

from controller.autoscale_policy import AutoscaleState, LoadSnapshot, ScaleDecision, decide
from controller.controller_errors import (ControllerError, DeployConflictError, InvalidMigrationError, InvalidSpecError,
                                         InvalidUploadError, MigrationConflictError, ModelAlreadyDeployedError,
                                         UnknownDeployError, UnknownInstanceError, UnknownModelError,
                                         UnknownTenantError, UnknownUploadError, UploadOffsetError)
from controller.model_spec import (
    AutoscalingPolicy,
    ModelSpec,
    ResourceSpec,
    SpecError,
    add_model_spec_arguments,
    load_model_spec,
    load_model_specs,
    model_spec_from_arguments,
    parse_model_id,
)
from controller.placement_policy import (
    NodeEstimate,
    NodeView,
    PlacementDecision,
    TierBandwidths,
    place,
    place_locality_blind,
)
from controller.routing_table import Route, RoutingTable
from controller.state_location import open_state_store
from controller.state_store import ApiKeyRecord, StateStore, StateStoreError, WorkerRecord, new_api_key
from controller.slot_outlook import SlotHolder, SlotOutlook
from controller.tenant_quota import TenantQuota, instances_over_quota, queued_over_quota

_LAZY = {
    "SlotSharingSettings": "controller.slot_sharing_settings",
    "ActorGoneError": "controller.cluster_client",
    "ClusterClient": "controller.cluster_client",
    "Controller": "controller.controller",
    "choose_destination": "controller.migration_policy",
    "ControllerActor": "controller.controller_actor",
    "ControllerConfig": "controller.controller_config",
    "DEFAULT_CONTROLLER_NAME": "controller.controller_actor",
    "RayClusterClient": "controller.ray_cluster_client",
    "RayNodeInfo": "controller.cluster_node",
    "NODE_ID_PREFIX_CHARS": "controller.cluster_node",
    "GatewayMetricsBoard": "controller.gateway_metrics_board",
    "get_controller": "controller.controller_actor",
    "node_store_actor_name": "controller.cluster_client",
    "repository_name": "controller.model_source",
    "start_controller": "controller.controller_actor",
    "stop_controller": "controller.controller_actor",
    "worker_actor_name": "controller.cluster_client",
    # The policy layer the simulator (sim/) drives unchanged, beside `decide` and `place` above.
    "desired_instances": "controller.autoscale_policy",
    "keep_alive_for": "controller.autoscale_policy",
    "EvictionCandidate": "controller.eviction_policy",
    "choose_eviction": "controller.eviction_policy",
    "PreemptionCandidate": "controller.preemption_policy",
    "choose_preemption": "controller.preemption_policy",
    "SlotReclaimCosts": "controller.slot_reclaim_policy",
    "plan_slot_reclaim": "controller.slot_reclaim_policy",
    "WaitingModel": "controller.slot_queue_policy",
    "order_waiting": "controller.slot_queue_policy",
    "PeerStreamSettings": "controller.stream_source_policy",
    "choose_load_path": "controller.stream_source_policy",
    "ManagedInstance": "controller.managed_instance",
    "UsageMeter": "controller.usage_meter",
    "HostSleeper": "controller.host_sleep_policy",
    "room_for_sleeper": "controller.host_sleep_policy",
    # The one planner of a model's tick, the controller's and the simulator's (`model_plan`).
    "plan_model": "controller.model_plan",
    "ModelView": "controller.model_plan",
    "InstanceView": "controller.model_plan",
    "ModelPlan": "controller.model_plan",
    "SlotHold": "controller.slot_holds",
    "views_past_holds": "controller.slot_holds",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'controller' has no attribute {name!r}")


__all__ = [
    "ActorGoneError", "ApiKeyRecord", "AutoscaleState", "AutoscalingPolicy", "ClusterClient", "Controller",
    "ControllerActor", "ControllerConfig", "ControllerError", "DEFAULT_CONTROLLER_NAME", "InvalidMigrationError",
    "DeployConflictError", "InvalidSpecError", "LoadSnapshot", "MigrationConflictError", "ModelAlreadyDeployedError", "ModelSpec", "NodeEstimate", "NodeView", "PlacementDecision",
    "GatewayMetricsBoard", "NODE_ID_PREFIX_CHARS", "RayClusterClient", "RayNodeInfo", "ResourceSpec", "Route", "RoutingTable", "ScaleDecision", "SpecError",
    "SlotHolder", "SlotOutlook", "SlotSharingSettings", "StateStore", "StateStoreError", "TenantQuota", "TierBandwidths", "UnknownDeployError", "UnknownInstanceError", "UnknownModelError", "UnknownUploadError",
    "InvalidUploadError", "UploadOffsetError",
    "UnknownTenantError",
    "WorkerRecord", "add_model_spec_arguments", "choose_destination", "decide", "get_controller",
    "instances_over_quota", "load_model_spec", "load_model_specs",
    "model_spec_from_arguments", "new_api_key", "node_store_actor_name", "open_state_store", "parse_model_id", "place",
    "place_locality_blind", "queued_over_quota", "repository_name", "start_controller", "stop_controller",
    "worker_actor_name",
    "desired_instances", "keep_alive_for", "EvictionCandidate", "choose_eviction", "PreemptionCandidate", "choose_preemption",
    "SlotReclaimCosts", "plan_slot_reclaim",
    "WaitingModel", "order_waiting", "PeerStreamSettings", "choose_load_path", "ManagedInstance",
    "UsageMeter", "HostSleeper", "room_for_sleeper", "plan_model", "ModelView", "InstanceView", "ModelPlan",
    "SlotHold", "views_past_holds",
]
