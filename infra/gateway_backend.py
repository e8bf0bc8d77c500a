"""What the HTTP gateway needs from the serving platform: `GatewayBackend`, and how it fails.

The gateway's FastAPI app (`gateway_app.build_gateway_app`) speaks HTTP and OpenAI's wire
format; everything behind it — which instance serves a model, the bounded cold-start queue,
Ray — sits behind this small protocol. That split lets the HTTP surface be tested end to end
in one process (`LocalEngineBackend` runs `worker.AsyncEngine`s directly), and lets the Ray
Serve ingress plug in a backend that talks to the controller and workers without the app
changing.

Failures a client should see with a particular status are exceptions of the `BackendError`
hierarchy; `openai_errors.error_from_backend` maps each to its HTTP status and OpenAI error
body. Anything else a backend raises is a bug and becomes a 500.

A backend that queues requests for a cold or saturated model may also yield `QueueProgress`
records while a request waits, which the gateway turns into SSE comment lines for streaming
clients (so a quiet connection is not timed out, and a user sees why it waits).

What a request is and what its stream carries -- `Prompt`, `SamplingParams`, `GenerationChunk`
-- are the platform's records from `wire/` (re-exported here), the same the workers use, so a
backend passes a worker's chunks on as they are; `wire` needs neither torch nor Ray, so neither
does the gateway's app. Messages carrying prompt or completion text print without it (house
rule: logs never leak prompts).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from wire import GenerationChunk, Prompt, SamplingParams

__all__ = [
    "BackendError", "BackendUnavailable", "ContextLengthExceeded", "GatewayBackend", "GenerationChunk",
    "InvalidRequest", "ModelCard", "ModelNotFound", "ModelOverloaded", "Prompt", "QueueProgress", "QueueTimeout",
    "RequestFailed", "SamplingParams",
]


@dataclass(frozen=True, kw_only=True)
class ModelCard:
    """A model as `GET /v1/models` shows it."""

    model_id: str  # "tenant/name"
    owned_by: str  # the tenant
    created_s: int  # Unix time the model was deployed (OpenAI's `created`)
    max_model_len: int | None = None  # longest prompt + output, when known
    # How the model writes tool calls (a `wire.TOOL_CALL_FORMATS` name); None: none the gateway reads.
    tool_call_format: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"model_id must be a non-empty string, got {self.model_id!r}")
        if not isinstance(self.owned_by, str) or not self.owned_by:
            raise ValueError(f"owned_by must be a non-empty string, got {self.owned_by!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be None or >= 1, got {self.max_model_len!r}")


@dataclass(frozen=True, kw_only=True)
class QueueProgress:
    """News for a request that still waits for an instance; it carries no output.

    A backend that queues yields one about every second while a request waits: before its
    first chunk, or mid-stream while a recovered request waits for another instance. `text`
    is one line a user can read (``waiting for a slot: position 2, about 1.4 s``); the gateway
    sends it to a streaming client as an SSE comment and drops it for any other.
    """

    text: str


class BackendError(Exception):
    """A failure the client is told about with a specific status (see `openai_errors`)."""


class ModelNotFound(BackendError):
    """No model with this id is deployed (404)."""

    def __init__(self, model_id: str) -> None:
        super().__init__(f"model {model_id!r} does not exist")
        self.model_id = model_id


class ModelOverloaded(BackendError):
    """The model's request queue is full (429): try again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueTimeout(BackendError):
    """No instance became ready before the queue deadline (503): try again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BackendUnavailable(BackendError):
    """The serving side cannot take requests now (engine died, controller unreachable): 503."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailed(BackendError):
    """The request itself failed on the serving side, and is not retried (500): it failed alone
    inside an engine that serves on, or an instance died running it twice (a poison pill must not
    take down instance after instance). The message says so without internal detail; the cause
    is logged."""


class InvalidRequest(BackendError):
    """The request is wrong for this model (400); `param` names the culprit field when known."""

    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthExceeded(InvalidRequest):
    """The prompt does not fit the model's context (400, code ``context_length_exceeded``)."""

    code = "context_length_exceeded"


@runtime_checkable
class GatewayBackend(Protocol):
    """The serving platform as the gateway sees it. Every method is called on the app's loop.

    Tenancy is the gateway's job (it checks a caller may use a model before calling here);
    a backend only needs `list_models` to filter by owner.
    """

    async def list_models(self, tenant: str | None) -> list[ModelCard]:
        """Models owned by `tenant`, or every model for None (admin, or auth turned off); sorted by id."""
        ...

    async def describe_model(self, model_id: str) -> ModelCard:
        """The model's card; raises `ModelNotFound`."""
        ...

    def generate(self, model_id: str, request_id: str, prompt: Prompt,
                 params: SamplingParams) -> AsyncIterator[GenerationChunk | QueueProgress]:
        """Streams one request's chunks until one has ``finished``.

        While the request waits for an instance, a backend that queues may yield `QueueProgress`
        records in between, about once a second (a backend that never queues yields none).

        Errors about the request itself (`InvalidRequest`, `ModelNotFound`, `ModelOverloaded`,
        `QueueTimeout`, `BackendUnavailable`) are raised before the first chunk, though
        `QueueTimeout` (and a model deleted meanwhile) may follow progress records. Closing the
        iterator early (the client left), also at a progress record, must free the request's
        resources and its place in a queue; the gateway also calls `abort`, so either alone is
        enough.
        """
        ...

    async def abort(self, model_id: str, request_id: str) -> None:
        """Cancels a request wherever it is (queued or running); unknown ids are ignored."""
        ...

    async def is_ready(self) -> bool:
        """True when the backend can take requests now (for ``GET /readyz``)."""
        ...
