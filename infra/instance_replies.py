"""An instance's answers in the gateway's terms: its chunks with the request's queue time, its
refusals as `InvalidRequest`s (a prompt over the context as `ContextLengthExceeded`).

Chunks are `wire.GenerationChunk`s on both sides, so a chunk needs no translation, only the
gateway's ``queue_s``. A chunk of another type with the same fields is copied into one: the
worker's own chunk class, until `worker.instance_worker` yields `wire.GenerationChunk` itself.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from infra.gateway_backend import ContextLengthExceeded, GenerationChunk, InvalidRequest

if TYPE_CHECKING:
    from worker import InvalidRequestError

__all__ = ["gateway_chunk", "invalid_request"]

_CHUNK_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationChunk) if f.name != "queue_s")


def gateway_chunk(chunk: Any, queue_s: float | None) -> GenerationChunk:
    """An instance's chunk with the gateway's `queue_s` (set on a request's first chunk only)."""
    if isinstance(chunk, GenerationChunk):
        return chunk if chunk.queue_s == queue_s else dataclasses.replace(chunk, queue_s=queue_s)
    return GenerationChunk(**{name: getattr(chunk, name) for name in _CHUNK_FIELDS}, queue_s=queue_s)


def invalid_request(exc: InvalidRequestError) -> InvalidRequest:
    """The worker's refusal as a 400 naming the field; a prompt over the context gets its own code."""
    message = getattr(exc, "message", None) or str(exc)
    field = getattr(exc, "field", None)
    if field in ("prompt", "messages") and "context" in message:
        return ContextLengthExceeded(message, field)
    return InvalidRequest(message, field)
