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
  specs, tenants, hashed API keys, desired counts and the worker registry, in SQLite or Redis.
"""

from controller.autoscale_policy import AutoscaleState, LoadSnapshot, ScaleDecision, decide
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
from controller.state_store import ApiKeyRecord, StateStore, StateStoreError, WorkerRecord, open_state_store

__all__ = [
    "ApiKeyRecord", "AutoscaleState", "AutoscalingPolicy", "LoadSnapshot", "ModelSpec", "NodeEstimate",
    "NodeView", "PlacementDecision", "ResourceSpec", "ScaleDecision", "SpecError", "StateStore",
    "StateStoreError", "TierBandwidths", "WorkerRecord", "add_model_spec_arguments", "decide",
    "load_model_spec", "load_model_specs", "model_spec_from_arguments", "open_state_store", "parse_model_id",
    "place", "place_locality_blind",
]
