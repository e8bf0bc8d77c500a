"""An idle timeout for a client's stream: a request that sends nothing and makes no progress for
``idle_timeout_s`` ends with `StreamIdleTimeout` instead of holding its client for ever.

Silence alone proves nothing: a request may wait for its instance to load, wait in the scheduler
for KV blocks, or prefill a long prompt chunk by chunk, all without a token. So the guard asks
the instance where the request stands (``probe``: a `worker.RequestProgress`) every quarter of the
timeout while the stream is quiet, and counts the silence only while the answers show no
progress (`is_progressing`): queued or loading is waiting its turn, and tokens or computed KV that
moved between two answers are work being done. A request frozen by a migration makes no
progress: a live driver finishes the stop in well under a second, and a dead one's freeze lapses
after its lease (`migration.lease_book`, 30 s by default), after which the source streams again.
An instance that does not answer (hung, gone, a handle without ``request_progress``), or does not
know the request, makes none either.

The default, 120 s, is far above any normal gap between two chunks (a long prefill shows
progress), and above the freeze lease, so a migration whose driver died is recovered by its source
before a client gives up.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from worker import RequestProgress, RequestState

__all__ = ["DEFAULT_STREAM_IDLE_TIMEOUT_S", "StreamIdleTimeout", "guard_idle", "is_progressing",
           "validate_idle_timeout_s"]

DEFAULT_STREAM_IDLE_TIMEOUT_S = 120.0

T = TypeVar("T")


class StreamIdleTimeout(RuntimeError):
    """A followed stream sent no chunk for ``idle_s`` seconds while its request was neither queued
    nor progressing on its instance (``last_state``: what the instance said last, None if it never
    answered). The request has been cancelled on its instance."""

    def __init__(self, request_id: str, idle_s: float, last_state: RequestState | None) -> None:
        said = "did not answer" if last_state is None else f"says it is {last_state.value}"
        super().__init__(f"request {request_id!r} sent nothing for {idle_s:.1f} s and its instance {said}; "
                         "it was cancelled there")
        self.request_id = request_id
        self.idle_s = idle_s
        self.last_state = last_state

    def __reduce__(self):
        return type(self), (self.request_id, self.idle_s, self.last_state)


def validate_idle_timeout_s(idle_timeout_s: float) -> float:
    if isinstance(idle_timeout_s, bool) or not isinstance(idle_timeout_s, (int, float)) \
            or not math.isfinite(idle_timeout_s) or idle_timeout_s <= 0:
        raise ValueError(f"idle_timeout_s must be a finite number of seconds > 0, got {idle_timeout_s!r}")
    return float(idle_timeout_s)


def is_progressing(previous: RequestProgress | None, current: RequestProgress | None) -> bool:
    """Whether the request is waiting its turn or doing work, given the instance's last two answers
    (None: no answer). Queued or loading: yes. Otherwise only if its state, tokens or computed KV
    changed since the previous answer -- a first answer alone shows no movement."""
    if current is None or current.state is RequestState.UNKNOWN:
        return False
    if current.state in (RequestState.QUEUED, RequestState.LOADING):
        return True
    if previous is None:
        return False
    return (current.state, current.num_tokens, current.num_computed_tokens) != \
        (previous.state, previous.num_tokens, previous.num_computed_tokens)


async def guard_idle(chunks: AsyncIterator[T], probe: Callable[[], Awaitable[RequestProgress]], *,
                     request_id: str, idle_timeout_s: float = DEFAULT_STREAM_IDLE_TIMEOUT_S,
                     clock: Callable[[], float] = time.monotonic) -> AsyncIterator[T]:
    """Yields ``chunks``; raises `StreamIdleTimeout` once none came for ``idle_timeout_s`` while
    ``probe`` showed no progress (module docstring). Closing it, or the timeout, closes ``chunks``
    (which cancels the request where it runs)."""
    idle_timeout_s = validate_idle_timeout_s(idle_timeout_s)
    probe_every_s = idle_timeout_s / 4
    last_progress_s = clock()
    previous: RequestProgress | None = None
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(chunks))
            done, _ = await asyncio.wait({pending}, timeout=probe_every_s)
            if done:
                finished, pending = pending, None
                try:
                    chunk = finished.result()
                except StopAsyncIteration:
                    return
                last_progress_s, previous = clock(), None
                yield chunk
                continue
            current = await _ask(probe, probe_every_s)
            if is_progressing(previous, current):
                last_progress_s = clock()
            previous = current
            idle_s = clock() - last_progress_s
            if idle_s >= idle_timeout_s:
                raise StreamIdleTimeout(request_id, idle_s, None if current is None else current.state)
    finally:
        if pending is not None and not pending.done():
            pending.cancel()  # raised inside the stream's generator: it cancels its own request
            await asyncio.wait({pending})
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()


async def _ask(probe: Callable[[], Awaitable[RequestProgress]], timeout_s: float) -> RequestProgress | None:
    """The instance's answer, or None if it gave none in time (or failed to)."""
    with contextlib.suppress(Exception):
        return await asyncio.wait_for(probe(), timeout_s)
    return None
