"""One generation request from backend to client: `GenerationStream` and `GenerationResponse`.

`GenerationStream` pulls a request's chunks from the backend, times them into the metrics
(time to first token, inter-token gaps, end to end, queue time) and, if it is closed before the
last chunk, aborts the request on the backend — that is what frees a worker's KV blocks when
a client goes away. It passes on the backend's `QueueProgress` records as they come.

`GenerationResponse` is the ASGI response that drives it, as server-sent events or as one JSON
body. A streaming request that waits in a cold model's queue gets each `QueueProgress` as an
SSE comment line (``: waiting for a slot: position 2, about 1.4 s``), about once a second, so
proxies and clients do not time out the quiet connection and a user sees why it waits; clients
skip comment lines (the `openai` SDK does). A non-streaming request never sees them. The
response is written out rather than built on Starlette's `StreamingResponse` for three reasons:

- the first chunk (or progress line) is awaited *before* the status line goes out, so a request
  that fails in the backend (a cold model's queue is full, the deadline passed, the prompt is
  too long) still gets its proper status (429/503/400 with ``Retry-After``), not a 200 followed
  by an error event. The exception is a streaming request whose first progress line went out:
  the status is 200 from then on, and a deadline passed later is reported in-band, as an error
  event before ``data: [DONE]`` (a non-streaming request keeps its 503);
- it listens for the client's ``http.disconnect`` the whole time — also while the request waits
  in a cold model's queue, before any byte is sent, and for non-streaming requests — since
  servers such as uvicorn drop writes to a closed connection silently instead of failing them;
- it always closes the stream (a shielded abort) however it ends, so no request is left
  running for nobody.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import anyio
from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from infra.gateway_backend import (BackendError, GatewayBackend, GenerationChunk, InvalidRequest, Prompt, QueueProgress,
                                   SamplingParams)
from infra.gateway_metrics import GatewayMetrics
from infra.openai_errors import OpenAIError, error_from_backend, internal_error
from infra.openai_responses import Usage
from wire import TokenLogprobs

if TYPE_CHECKING:  # choice_streams builds on GenerationStream, defined here
    from infra.choice_streams import ChoiceItem, ChoiceStreams

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first", used in metrics only
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_DONE = b"data: [DONE]\n\n"


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


class Renderer(Protocol):
    """How chunks become OpenAI objects (`openai_renderers.CompletionRenderer` / `ChatRenderer`)."""

    def stream_objects(self, chunk: GenerationChunk, is_first: bool, usage: Usage | None = None) -> list[BaseModel]:
        """The SSE objects for one chunk; each carries `usage` when given (continuous usage)."""

    def usage_object(self, usage: Usage) -> BaseModel: ...

    def whole(self, text: str, finish_reason: str | None, usage: Usage,
              logprobs: Sequence[TokenLogprobs] | None = None) -> BaseModel:
        """The whole response; `logprobs` holds every token's when the request asked for them."""


class GenerationResponse(Response):
    """Sends one generation as SSE (``stream=True``) or one JSON body; see the module docstring.

    `on_done(status)` is called once with the HTTP status the client got (499 if it left).
    """

    def __init__(self, choices: ChoiceStreams, renderers: Sequence[Renderer], *, streaming: bool,
                 include_usage: bool, on_done: Callable[[int], None], continuous_usage: bool = False,
                 param_names: Mapping[str, str] | None = None) -> None:
        # Response.__init__ would render a body; this response writes its own messages.
        if len(renderers) != len(choices.streams):
            raise ValueError(f"one renderer per choice: {len(renderers)} for {len(choices.streams)} choices")
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"x-request-id", choices.request_id.encode())]
        self._stream = choices
        self._renderers = list(renderers)
        self._streaming = streaming
        self._include_usage = include_usage
        self._continuous_usage = continuous_usage
        self._on_done = on_done
        # A worker names the SamplingParams field it refused; the client knows the field it sent.
        self._param_names = dict(param_names or {})
        self._status = 0
        self._complete = False  # the last body message is being (or has been) sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        left = False
        async with anyio.create_task_group() as task_group:

            async def watch_disconnect() -> None:
                nonlocal left
                try:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                except Exception as exc:  # noqa: BLE001 - see below
                    # The server's receive channel failed (Ray Serve's replica raises its call to
                    # the proxy's error here): that says nothing about the client, whose stream
                    # goes on. A client that did leave is still noticed: a write fails (OSError)
                    # or the server cancels the request.
                    logger.warning("the receive channel of %s failed (%s: %s); the response goes on without "
                                   "watching for a disconnect", self._stream.request_id, type(exc).__name__, exc)
                    return
                # Servers also report a disconnect once the response is complete: that is no early exit.
                if not self._complete:
                    logger.info("client of %s disconnected (status %s)", self._stream.request_id,
                                self._status or "not sent")
                    left = True
                    task_group.cancel_scope.cancel()

            task_group.start_soon(watch_disconnect)
            try:
                await self._respond(send)
            except OSError as exc:  # ASGI 2.4 servers raise on writes to a closed connection
                logger.info("client of %s gone: a write failed: %s", self._stream.request_id, exc)
                left = True
            except BaseException as exc:
                # Issue 44: something ends a resumed stream before its last chunk with nothing
                # logged (a cancellation, not an error: errors are reported in-band). Say so.
                if not left and not self._complete:
                    logger.warning("response of %s ended before its last chunk (status %s): %s", self._stream.request_id,
                                   self._status or "not sent", type(exc).__name__)
                raise
            finally:
                await self._stream.close()
                task_group.cancel_scope.cancel()
        self._on_done(CLIENT_CLOSED_REQUEST if left else self._status)
        if self.background is not None:  # FastAPI hands a route's BackgroundTasks to its response
            await self.background()

    async def _respond(self, send: Send) -> None:
        try:
            first = await self._stream.next()
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error
            await self._send_error(send, self._error_for(exc))
            return
        if self._streaming:
            await self._send_events(send, first)
        else:
            await self._send_whole(send, first)

    async def _send_events(self, send: Send, item: ChoiceItem | None) -> None:
        self._status = 200
        await send({"type": "http.response.start", "status": 200, "headers": [*self.raw_headers, *_SSE_HEADERS]})
        started: set[int] = set()
        latest: dict[int, GenerationChunk] = {}
        try:
            while item is not None:
                index, record = item
                if isinstance(record, QueueProgress):
                    await send({"type": "http.response.body", "body": _sse_comment(record.text), "more_body": True})
                else:
                    latest[index] = record
                    usage = _total_usage(latest.values()) if self._continuous_usage else None
                    for obj in self._renderers[index].stream_objects(record, index not in started, usage):
                        await send({"type": "http.response.body", "body": _sse(obj), "more_body": True})
                    started.add(index)
                item = await self._stream.next()
            lasts = [self._stream.last(i) for i in range(len(self._renderers))]
            if self._include_usage and all(last is not None for last in lasts):
                usage = _total_usage(lasts)  # type: ignore[arg-type]
                await send({"type": "http.response.body", "body": _sse(self._renderers[0].usage_object(usage)),
                            "more_body": True})
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - the status line is out: report in-band, as OpenAI does
            error = self._error_for(exc)
            self._status = error.status_code
            await send({"type": "http.response.body", "body": error.sse_event(), "more_body": True})
        await self._send_last(send, _DONE)

    async def _send_whole(self, send: Send, item: ChoiceItem | None) -> None:
        parts: list[list[str]] = [[] for _ in self._renderers]
        logprobs: list[list[TokenLogprobs] | None] = [None for _ in self._renderers]
        try:
            while item is not None:
                index, record = item
                if isinstance(record, GenerationChunk):  # progress is for streams only
                    parts[index].append(record.text)
                    if record.logprobs is not None:
                        kept = logprobs[index] if logprobs[index] is not None else []
                        kept.extend(record.logprobs)
                        logprobs[index] = kept
                item = await self._stream.next()
        except Exception as exc:  # noqa: BLE001
            await self._send_error(send, self._error_for(exc))
            return
        lasts = [self._stream.last(i) for i in range(len(self._renderers))]
        if any(last is None for last in lasts):
            await self._send_error(send, self._error_for(RuntimeError("the backend produced no output")))
            return
        usage = _total_usage(lasts)  # type: ignore[arg-type]
        wholes = [renderer.whole("".join(parts[i]), lasts[i].finish_reason, usage, logprobs[i])  # type: ignore[union-attr]
                  for i, renderer in enumerate(self._renderers)]
        response = wholes[0] if len(wholes) == 1 else wholes[0].model_copy(
            update={"choices": [choice for whole in wholes for choice in whole.choices]})  # type: ignore[attr-defined]
        body = response.model_dump_json().encode()
        self._status = 200
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*self.raw_headers, (b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await self._send_last(send, body)

    async def _send_error(self, send: Send, error: OpenAIError) -> None:
        self._status = error.status_code
        body = json.dumps(error.body()).encode()
        headers = [*self.raw_headers, (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()),
                   *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
        await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
        await self._send_last(send, body)

    async def _send_last(self, send: Send, body: bytes) -> None:
        self._complete = True
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _error_for(self, exc: Exception) -> OpenAIError:
        if isinstance(exc, InvalidRequest) and exc.param in self._param_names:
            exc = copy.copy(exc)  # keeps its class and code
            exc.param = self._param_names[exc.param]
        if isinstance(exc, BackendError):
            return error_from_backend(exc)
        if isinstance(exc, OpenAIError):
            return exc
        logger.error("request %s failed", self._stream.request_id, exc_info=exc)
        return internal_error()


def _sse(obj: BaseModel) -> bytes:
    return b"data: " + obj.model_dump_json().encode() + b"\n\n"


def _sse_comment(text: str) -> bytes:
    """One SSE comment line; line breaks in `text` become spaces (one would end the comment)."""
    return b": " + " ".join(text.splitlines()).encode() + b"\n\n"


def _total_usage(lasts: Iterable[GenerationChunk]) -> Usage:
    """A request's usage from its choices' latest chunks: the prompt once (every choice has the
    same; its cached tokens are the first choice's), the completions' tokens summed (OpenAI's
    rule for ``n``)."""
    lasts = list(lasts)
    if not lasts:
        return Usage.of(0, 0)
    return Usage.of(lasts[0].num_prompt_tokens, sum(c.num_completion_tokens for c in lasts),
                    lasts[0].num_cached_tokens)
