"""What the gateway keeps of a deployed model: `ModelInfo`, read from the controller's model record.

The card `GET /v1/models` shows and the limits of the model's request queue (how many may wait,
and for how long), taken from the spec's autoscaling section with the spec's own defaults where
a record leaves them out. Kept apart from `RayGatewayBackend`, which only looks them up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infra.gateway_backend import ModelCard

__all__ = ["ModelInfo", "model_info_from_record"]


@dataclass(frozen=True)
class ModelInfo:
    """What the backend keeps of a deployed model: its card and its queue's limits."""

    card: ModelCard
    max_queued_requests: int
    queue_timeout_s: float


def model_info_from_record(record: Mapping[str, Any]) -> ModelInfo:
    """A model record of the controller (its spec, flat or under ``"spec"``) as `ModelInfo`."""
    spec = record.get("spec", record)
    model_id = record.get("model_id") or spec.get("model_id") or f"{spec['tenant']}/{spec['name']}"
    tenant = model_id.partition("/")[0]
    autoscaling = spec.get("autoscaling") or {}
    created = record.get("created_s", record.get("deployed_s", spec.get("created_s", 0))) or 0
    card = ModelCard(model_id=model_id, owned_by=tenant, created_s=int(created),
                     max_model_len=record.get("max_model_len") or spec.get("max_model_len"))
    return ModelInfo(card=card, max_queued_requests=int(autoscaling.get("max_queued_requests", 100)),
                      queue_timeout_s=float(autoscaling.get("queue_timeout_s", 60.0)))
