"""An instance's answers in the gateway's terms: its chunks with the request's queue time, its
refusals as `InvalidRequest`s (a prompt over the context as `ContextLengthExceeded`).

Chunks are `wire.GenerationChunk`s on both sides, so a chunk needs no translation, only the
gateway's ``queue_s``.
"""

from __future__ import annotations

import dataclasses

from infra.gateway_backend import ContextLengthExceeded, GenerationChunk, InvalidRequest
from wire import InvalidRequestError

__all__ = ["gateway_chunk", "invalid_request"]

def gateway_chunk(chunk: GenerationChunk, queue_s: float | None) -> GenerationChunk:
    """An instance's chunk with the gateway's `queue_s` (set on a request's first chunk only)."""
    return chunk if chunk.queue_s == queue_s else dataclasses.replace(chunk, queue_s=queue_s)


def invalid_request(exc: InvalidRequestError) -> InvalidRequest:
    """The worker's refusal as a 400 naming the field; a prompt over the context gets its own code."""
    message = getattr(exc, "message", None) or str(exc)
    field = getattr(exc, "field", None)
    if field in ("prompt", "messages") and "context" in message:
        return ContextLengthExceeded(message, field)
    return InvalidRequest(message, field)
