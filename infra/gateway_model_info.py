"""What the gateway keeps of a deployed model: `ModelInfo`, read from the controller's `wire.ModelRecord`.

The card `GET /v1/models` shows (its ``created`` is when the controller deployed the model) and
the limits of the model's request queue (how many may wait, and for how long). The record is the
one the controller builds (`Controller.model_records`), so no key is guessed here. Kept apart from
`RayGatewayBackend`, which only looks them up.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.gateway_backend import ModelCard
from wire import ModelRecord

__all__ = ["ModelInfo", "model_info_from_record"]


@dataclass(frozen=True)
class ModelInfo:
    """What the backend keeps of a deployed model: its card and its queue's limits."""

    card: ModelCard
    max_queued_requests: int
    queue_timeout_s: float


def model_info_from_record(record: ModelRecord) -> ModelInfo:
    """The controller's record of a model as `ModelInfo`. A model whose deploy time the controller
    does not know (deployed before it restarted) shows ``created`` 0, as OpenAI's field needs an int."""
    if not isinstance(record, ModelRecord):
        raise TypeError(f"expected a wire.ModelRecord from the controller, got {type(record).__name__}")
    card = ModelCard(model_id=record.model_id, owned_by=record.tenant,
                     created_s=int(record.deployed_s) if record.deployed_s is not None else 0,
                     max_model_len=record.max_model_len, tool_call_format=record.tool_call_format)
    return ModelInfo(card=card, max_queued_requests=record.max_queued_requests,
                     queue_timeout_s=record.queue_timeout_s)
