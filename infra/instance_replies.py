"""An instance's answers in the gateway's terms: its chunks as `GenerationChunk`s, its refusals as
`InvalidRequest`s (a prompt over the context as `ContextLengthExceeded`). The worker names some
things differently (``num_completion_tokens``); this is the one place that translates.
"""

from __future__ import annotations

from typing import Any

from infra.gateway_backend import ContextLengthExceeded, GenerationChunk, InvalidRequest
from worker import InvalidRequestError

__all__ = ["gateway_chunk", "invalid_request"]


def gateway_chunk(chunk: Any, queue_s: float | None) -> GenerationChunk:
    """A worker's chunk as the gateway's (`worker.GenerationChunk` names the counts differently)."""
    return GenerationChunk(request_id=chunk.request_id, text=chunk.text, token_ids=tuple(chunk.token_ids),
                           finished=chunk.finish_reason is not None, finish_reason=chunk.finish_reason,
                           num_prompt_tokens=chunk.num_prompt_tokens, num_output_tokens=chunk.num_completion_tokens,
                           queue_s=queue_s)


def invalid_request(exc: InvalidRequestError) -> InvalidRequest:
    """The worker's refusal as a 400 naming the field; a prompt over the context gets its own code."""
    message = getattr(exc, "message", None) or str(exc)
    field = getattr(exc, "field", None)
    if field in ("prompt", "messages") and "context" in message:
        return ContextLengthExceeded(message, field)
    return InvalidRequest(message, field)
