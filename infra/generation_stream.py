"""One backend request's chunks as the gateway reads them: `GenerationStream`.

It pulls a request's chunks from the backend, times them into the metrics (time to first token,
inter-token gaps, end to end, queue time) and, if it is closed before the last chunk, aborts the
request on the backend — that is what frees a worker's KV blocks when a client goes away. It
passes on the backend's `QueueProgress` records as they come. A request's choices read several
(`infra.choice_streams`); the response renders them (`infra.gateway_stream`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio

from infra.gateway_backend import GatewayBackend, GenerationChunk, Prompt, QueueProgress, SamplingParams
from infra.gateway_metrics import GatewayMetrics

__all__ = ["GenerationStream", "RequestInfo"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestInfo:
    """What the metrics and the response need to know about one request."""

    model_id: str
    request_id: str
    endpoint: str  # "completions" or "chat"
    arrival_s: float  # on `clock`


class GenerationStream:
    """A backend request's chunks (and progress records), measured as they arrive; aborted if
    closed before the end."""

    def __init__(self, backend: GatewayBackend, metrics: GatewayMetrics, info: RequestInfo, prompt: Prompt,
                 params: SamplingParams, clock: Callable[[], float] = time.monotonic) -> None:
        self.info = info
        self._backend = backend
        self._metrics = metrics
        self._clock = clock
        self._chunks: AsyncIterator[GenerationChunk | QueueProgress] = backend.generate(
            info.model_id, info.request_id, prompt, params)
        self._ended = False  # the backend said its last word (a finished chunk, the end, or an error)
        self._num_chunks = 0
        self._last_token_s: float | None = None
        self.last: GenerationChunk | None = None
        self._abort_task: asyncio.Future[None] | None = None

    async def next(self) -> GenerationChunk | QueueProgress | None:
        """The next chunk or progress record, or None after the last chunk. Backend errors propagate."""
        if self._ended:
            return None
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            self._ended = True
            return None
        except Exception:
            # An error ends the backend's iterator, which cleaned up after itself. A cancellation
            # (not an Exception) leaves the request running: `close` still aborts it.
            self._ended = True
            raise
        if isinstance(chunk, GenerationChunk):
            self._observe(chunk)
        return chunk

    def _observe(self, chunk: GenerationChunk) -> None:
        now, model = self._clock(), self.info.model_id
        if self._num_chunks == 0 and chunk.queue_s is not None:
            self._metrics.record_queue_time(model, chunk.queue_s)
        self._num_chunks += 1
        if chunk.token_ids:
            if self._last_token_s is None:
                self._metrics.record_first_token(model, now - self.info.arrival_s)
            else:
                self._metrics.record_inter_token(model, (now - self._last_token_s) / len(chunk.token_ids))
            self._last_token_s = now
        self.last = chunk
        if chunk.finished:
            self._ended = True
            self._metrics.record_finished(model, now - self.info.arrival_s, chunk.num_prompt_tokens,
                                          chunk.num_completion_tokens)

    async def close(self) -> None:
        """Aborts the request unless the backend already finished it, and closes the backend's
        iterator; never raises an error of its own. This runs as a cancelled request unwinds, so
        it is shielded from the cancel scope, and the abort runs as a task of its own: a native
        ``task.cancel()`` (Ray Serve's way of saying the client left) can interrupt the wait,
        but never the abort."""
        with anyio.CancelScope(shield=True):
            try:
                if not self._ended:
                    self._ended = True
                    self._abort_task = asyncio.ensure_future(self._abort())
                    await asyncio.shield(self._abort_task)
            finally:
                aclose = getattr(self._chunks, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except Exception:  # noqa: BLE001 - the request's own outcome matters more
                        logger.exception("closing the backend stream of %s failed", self.info.request_id)

    async def _abort(self) -> None:
        try:
            await self._backend.abort(self.info.model_id, self.info.request_id)
        except Exception:  # noqa: BLE001 - a failed abort must not hide the request's own outcome
            logger.exception("abort of %s failed", self.info.request_id)
