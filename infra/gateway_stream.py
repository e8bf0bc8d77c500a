"""One generation request to the client: `GenerationResponse`, the ASGI response that drives a
request's `infra.choice_streams.ChoiceStreams` (its choices' `infra.generation_stream`s), as
server-sent events or as one JSON body. A streaming request that waits in a cold model's queue
gets each `QueueProgress` as an SSE comment line (``: waiting for a slot: position 2, about
1.4 s``), about once a second, so proxies and clients do not time out the quiet connection and a
user sees why it waits; clients skip comment lines (the `openai` SDK does). A non-streaming
request never sees them. The response is written out rather than built on Starlette's
`StreamingResponse` for three reasons:

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

import copy
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import anyio
from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from infra.choice_streams import ChoiceItem, ChoiceStreams
from infra.gateway_backend import BackendError, GenerationChunk, InvalidRequest, QueueProgress
from infra.openai_errors import OpenAIError, error_from_backend, internal_error
from infra.openai_responses import Usage
from wire import TokenLogprobs

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first", used in metrics only
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_DONE = b"data: [DONE]\n\n"


class _ClientGone(Exception):
    """A write to the client failed (ASGI 2.4 servers raise an `OSError` on a closed connection).

    Only a failed *write* means the client left. The backend's own errors are reported to the
    client in-band, including a `TimeoutError` (an `OSError` too) from a call the backend makes.
    Before this class, such an error cut its stream as if the client had left (issue 44's cut
    stream)."""


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

            async def write(message: Message) -> None:
                try:
                    await send(message)
                except OSError as exc:
                    raise _ClientGone(str(exc)) from exc

            task_group.start_soon(watch_disconnect)
            try:
                await self._respond(write)
            except _ClientGone as exc:
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
        except _ClientGone:
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
