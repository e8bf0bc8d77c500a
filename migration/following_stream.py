"""The client's side of a request that may move: one stream of chunks, whichever instances produce
them. This is what the gateway reads instead of `stream_generation` to make migration invisible.

A stream that ends with ``finish_reason="migrated"`` is not the end: the chunk is swallowed, the
old instance is asked where the request went (``handoff_target``), ``resolve`` turns that
instance id into an actor handle (the gateway's routing table), and the new instance's
``resume`` stream takes over from the first token after the hand-off. The chunks yielded are then
exactly those of the request unmoved: the source delivered every token up to its stop, the
destination every one after, and the text deltas continue mid-character and mid-stop-string
because the destination replayed the detokenizer.

Leaving early cancels whichever stream is open, which aborts the request where it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from worker import GenerationChunk, SamplingParams, UnknownRequestError, stream_generation

__all__ = ["follow_generation"]

MIGRATED = "migrated"


async def follow_generation(handle: Any, request_id: str, prompt: str | list,
                            sampling_params: Mapping[str, Any] | SamplingParams | None = None, *,
                            resolve: Callable[[str], Awaitable[Any]]) -> AsyncIterator[GenerationChunk]:
    """`stream_generation` that follows the request across live migrations (module docstring).
    Raises `UnknownRequestError` if a stream ended "migrated" but its instance cannot say where to."""
    chunks = stream_generation(handle, request_id, prompt, sampling_params)
    while True:
        migrated = False
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if chunk.finish_reason == MIGRATED:
                    migrated = True
                    break
                yield chunk
        if not migrated:
            return
        target = await handle.handoff_target.remote(request_id)
        if target is None:
            raise UnknownRequestError(f"request {request_id!r} left its instance for an unknown one")
        handle = await resolve(target)
        chunks = _resume_stream(handle, request_id)


async def _resume_stream(handle: Any, request_id: str) -> AsyncIterator[GenerationChunk]:
    """``handle.resume`` read the way `stream_generation` reads ``generate``."""
    import ray

    stream = handle.resume.options(num_returns="streaming").remote(request_id)
    finished = False
    try:
        async for ref in stream:
            try:
                chunk = await ref
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, UnknownRequestError):
                    raise exc.cause from exc
                raise
            finished = chunk.finished
            yield chunk
    finally:
        if not finished:
            ray.cancel(stream)
