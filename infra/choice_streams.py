"""The choices of one request as one sequence of items: `ChoiceStreams`.

OpenAI's ``n`` asks for several completions of one prompt. The gateway runs them as ``n``
backend requests (``<id>-0`` ... ``<id>-<n-1>``, the seeded ones with seeds ``seed + i``, as vLLM
does), each an ordinary request that queues, migrates and recovers on its own. Choice 0 goes
first; the others are sent once choice 0's first token arrived, when its prompt's KV blocks are
computed and the worker's prefix cache shares them (sent together, all ``n`` would compute the
prompt in the same step). If choice 0 fails before its first token, the others are not sent.

`next` yields ``(choice index, chunk or progress)`` in arrival order; progress records are passed
on from choice 0 only (the others' queue is the same queue). One choice's error ends the whole
request: `close` aborts every choice still running. With one choice no task is started: items come
straight from its stream, as before ``n`` existed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import anyio

from infra.gateway_backend import GenerationChunk, QueueProgress
from infra.generation_stream import GenerationStream

__all__ = ["ChoiceItem", "ChoiceStreams"]

ChoiceItem = tuple[int, GenerationChunk | QueueProgress]


class ChoiceStreams:
    """``n`` `GenerationStream`s read as one (see the module docstring)."""

    def __init__(self, request_id: str, streams: Sequence[GenerationStream]) -> None:
        if not streams:
            raise ValueError("a request has at least one choice")
        self.request_id = request_id  # the client's id for the whole request
        self.streams = list(streams)
        self._queue: asyncio.Queue[ChoiceItem | BaseException | None] | None = None
        self._pumps: list[asyncio.Task[None]] = []
        self._open = len(self.streams)
        self._first_token = asyncio.Event()

    def last(self, index: int) -> GenerationChunk | None:
        return self.streams[index].last

    async def next(self) -> ChoiceItem | None:
        """The next item of any choice, or None once every choice ended. A choice's error propagates."""
        if len(self.streams) == 1:
            item = await self.streams[0].next()
            return None if item is None else (0, item)
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._pumps = [asyncio.ensure_future(self._pump(i)) for i in range(len(self.streams))]
        while self._open:
            item = await self._queue.get()
            if item is None:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return item
        return None

    async def _pump(self, index: int) -> None:
        assert self._queue is not None
        stream = self.streams[index]
        try:
            if index > 0:
                await self._first_token.wait()
            while (item := await stream.next()) is not None:
                if isinstance(item, GenerationChunk):
                    if index == 0 and item.token_ids:
                        self._first_token.set()
                    self._queue.put_nowait((index, item))
                elif index == 0:
                    self._queue.put_nowait((index, item))
            if index == 0:
                self._first_token.set()  # ended without a token (an empty output): let the others go
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which ends the request
            self._queue.put_nowait(exc)
            return
        self._queue.put_nowait(None)

    async def close(self) -> None:
        """Stops every choice: pending ones are never sent, running ones are aborted. Shielded, as
        `GenerationStream.close`: it runs while a cancelled request unwinds."""
        with anyio.CancelScope(shield=True):
            for task in self._pumps:
                task.cancel()
            for task in self._pumps:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for stream in self.streams:
                await stream.close()
