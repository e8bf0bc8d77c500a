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

A request released to `PARKED` (its slot was preempted and its KV parked in memory,
`migration.parking_endpoint`) ends this stream with a chunk of finish reason "suspended", as a
request whose tokens were suspended does: the caller queues it for its model's next instance.

The same stream also carries a request on after its instance *died* (``sent_token_ids``): the
new instance's ``recover`` continues it from the tokens the client already has, and any later
migration is followed as usual.

No wait is unbounded: a stream that sends nothing for ``idle_timeout_s`` while its instance shows
no progress for the request (`migration.stream_idle_timeout`: queued or loading counts as waiting
its turn, a growing prefill as progress, a frozen or unknown request or a silent instance as
nothing) is cancelled where it runs and raises `StreamIdleTimeout`; so does an old instance that
does not say within ``idle_timeout_s`` where a migrated request went.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from migration.parking_endpoint import PARKED
from migration.stream_idle_timeout import (DEFAULT_STREAM_IDLE_TIMEOUT_S, StreamIdleTimeout, guard_idle,
                                           validate_idle_timeout_s)
from wire import FinishReason, Prompt, call, stream
from worker import (GenerationChunk, RequestProgress, SamplingParams, UnknownRequestError,
                    stream_generation)

__all__ = ["StreamIdleTimeout", "follow_generation"]


async def follow_generation(handle: Any, request_id: str, prompt: Prompt,
                            sampling_params: Mapping[str, Any] | SamplingParams | None = None, *,
                            resolve: Callable[[str], Awaitable[Any]],
                            sent_token_ids: Sequence[int] = (),
                            idle_timeout_s: float = DEFAULT_STREAM_IDLE_TIMEOUT_S) -> AsyncIterator[GenerationChunk]:
    """`stream_generation` that follows the request across live migrations (module docstring).

    With ``sent_token_ids`` (output tokens a client already received from an instance that died)
    the request is not started but continued on ``handle`` from there (its ``recover``), and
    only what comes after them is yielded. Raises `UnknownRequestError` if a stream ended
    "migrated" but its instance cannot say where to; `StreamIdleTimeout` if nothing came for
    ``idle_timeout_s`` while the request made no progress (the request is then cancelled on its
    instance); the instance's refusals (`MigrationRefusedError`, `InvalidRequestError`,
    `EngineDeadError`, ...) as themselves."""
    idle_timeout_s = validate_idle_timeout_s(idle_timeout_s)
    if sent_token_ids:
        chunks = _actor_stream(handle, "recover", request_id, prompt, sampling_params, list(sent_token_ids))
    else:
        chunks = stream_generation(handle, request_id, prompt, sampling_params)
    while True:
        migrated = False
        guarded = guard_idle(chunks, _progress_probe(handle, request_id), request_id=request_id,
                             idle_timeout_s=idle_timeout_s)
        async with contextlib.aclosing(guarded):
            async for chunk in guarded:
                if chunk.finish_reason == FinishReason.MIGRATED:
                    migrated = True
                    break
                yield chunk
        if not migrated:
            return
        try:
            target = await call(handle.handoff_target.remote(request_id), idle_timeout_s)
        except TimeoutError:
            raise StreamIdleTimeout(request_id, idle_timeout_s, None) from None
        if target == PARKED:
            yield GenerationChunk(request_id=request_id, text="", token_ids=(), finish_reason=FinishReason.SUSPENDED.value,
                                  num_prompt_tokens=chunk.num_prompt_tokens,
                                  num_completion_tokens=chunk.num_completion_tokens)
            return
        if target is None:
            raise UnknownRequestError(f"request {request_id!r} left its instance for an unknown one")
        handle = await resolve(target)
        chunks = _actor_stream(handle, "resume", request_id)


def _progress_probe(handle: Any, request_id: str) -> Callable[[], Awaitable[RequestProgress]]:
    """Asks ``handle`` where the request stands (`MigratableInstanceActor.request_progress`)."""
    async def probe() -> RequestProgress:
        return await call(handle.request_progress.remote(request_id), None)

    return probe


async def _actor_stream(handle: Any, method: str, *args: Any) -> AsyncIterator[GenerationChunk]:
    """``handle.<method>(*args)`` (``resume`` or ``recover``) read the way `stream_generation`
    reads ``generate`` (`wire.stream`: the instance's own errors as themselves, a dead actor as
    `wire.ActorGoneError`; leaving early cancels the stream, which aborts the request there)."""
    chunks = stream(getattr(handle, method).options(num_returns="streaming").remote(*args),
                    is_last=lambda chunk: chunk.finished)
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            yield chunk
