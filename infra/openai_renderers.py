"""How one request's `GenerationChunk`s become OpenAI objects: `CompletionRenderer`, `ChatRenderer`.

A renderer knows the request's id, model and creation time, and turns each streamed chunk into
the objects sent as SSE events (`stream_objects`), the closing usage chunk (`usage_object`), or
the whole response when the client did not stream (`whole`). `gateway_stream.GenerationResponse`
drives it and never looks at which endpoint it serves.

Log-probabilities, when the request asked for them, come with the chunks (`wire.TokenLogprobs`,
one per token) and are rendered in each endpoint's form: chat's ``logprobs.content`` list with
each token's UTF-8 bytes, completions' parallel lists with each token's offset in the text. JSON
has no ``-inf``; a token the model rules out is rendered as -9999.0, as vLLM does. A renderer
serves one request and keeps that request's running state (the completion's text offset).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel

from infra.gateway_backend import GenerationChunk
from infra.forced_tool_calls import ForcedToolCalls
from infra.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCallDelta,
    FunctionCallOut,
    ToolCallDeltaOut,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from infra.tool_call_parser import (
    ContentDelta,
    StreamDelta,
    ToolCallStreamParser,
    merge_deltas,
    tool_calls_finish_reason,
)
from wire import TokenLogprobs

__all__ = ["ChatRenderer", "CompletionRenderer"]


# What JSON gets for a log-probability of -inf (vLLM's choice).
NEG_INF_LOGPROB = -9999.0


def _number(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NEG_INF_LOGPROB


def _top(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=_number(logprob), bytes=list(token.encode("utf-8", "replace")))


def chat_logprobs(entries: Sequence[TokenLogprobs]) -> ChatLogprobs:
    """Chat's form: one entry per token, with its bytes and its position's top alternatives."""
    return ChatLogprobs(content=[
        ChatTokenLogprob(**_top(e.token, e.logprob).model_dump(),
                         top_logprobs=[_top(t, lp) for t, lp in zip(e.top_tokens, e.top_logprobs)])
        for e in entries
    ])


@dataclass
class CompletionRenderer:
    """Turns one request's `GenerationChunk`s into ``text_completion`` objects."""

    request_id: str
    model: str
    created: int
    index: int = 0  # the choice's place among the request's ``n``
    echo: str = field(default="", repr=False)  # the prompt's text, sent before the completion's (``echo``)
    _text_offset: int = field(default=0, init=False)  # where the next token starts in the completion's text

    def _logprobs(self, entries: Sequence[TokenLogprobs] | None) -> CompletionLogprobs | None:
        if entries is None:
            return None
        offsets = []
        for entry in entries:
            offsets.append(self._text_offset)
            self._text_offset += len(entry.token)
        return CompletionLogprobs(
            tokens=[e.token for e in entries], token_logprobs=[_number(e.logprob) for e in entries],
            top_logprobs=[{t: _number(lp) for t, lp in zip(e.top_tokens, e.top_logprobs)} for e in entries],
            text_offset=offsets)

    def stream_objects(self, chunk: GenerationChunk, is_first: bool, usage: Usage | None = None) -> list[BaseModel]:
        text = self.echo + chunk.text if is_first else chunk.text
        if not text and not chunk.finished and not chunk.logprobs:
            return []  # a token that completes no character yet (part of a UTF-8 sequence)
        choice = CompletionChoice(index=self.index, text=text, logprobs=self._logprobs(chunk.logprobs),
                                  finish_reason=chunk.finish_reason if chunk.finished else None)
        return [CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                                   usage=usage)]

    def usage_object(self, usage: Usage) -> BaseModel:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage)

    def whole(self, text: str, finish_reason: str | None, usage: Usage,
              logprobs: Sequence[TokenLogprobs] | None = None) -> BaseModel:
        choice = CompletionChoice(index=self.index, text=self.echo + text, logprobs=self._logprobs(logprobs),
                                  finish_reason=finish_reason)
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                                  usage=usage)


@dataclass
class ChatRenderer:
    """Turns one request's `GenerationChunk`s into ``chat.completion(.chunk)`` objects.

    With `tool_parser` (a request with ``tools`` to a model whose tool-call format is known), the
    text goes through it: what is a tool call becomes ``tool_calls`` (streamed as deltas, the name
    first and the arguments in pieces), the rest ``content``, and a reply that called tools ends
    with ``finish_reason`` "tool_calls"."""

    request_id: str
    model: str
    created: int
    index: int = 0  # the choice's place among the request's ``n``
    tool_parser: ToolCallStreamParser | ForcedToolCalls | None = None

    def _chunk(self, delta: ChatDelta, finish_reason: str | None = None, usage: Usage | None = None,
               logprobs: ChatLogprobs | None = None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=self.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                                   usage=usage)

    def stream_objects(self, chunk: GenerationChunk, is_first: bool, usage: Usage | None = None) -> list[BaseModel]:
        # Like OpenAI: the first chunk announces the role with empty content.
        objects: list[BaseModel] = [self._chunk(ChatDelta(role="assistant", content=""), usage=usage)] \
            if is_first else []
        logprobs = chat_logprobs(chunk.logprobs) if chunk.logprobs is not None else None
        finish_reason = chunk.finish_reason if chunk.finished else None
        if self.tool_parser is None:
            deltas = [ChatDelta(content=chunk.text)] if chunk.text else []
        else:
            parsed = self.tool_parser.feed(chunk.text)
            if chunk.finished:
                parsed += self.tool_parser.finish()
                finish_reason = tool_calls_finish_reason(finish_reason, self.tool_parser.num_tool_calls)
            deltas = _chat_deltas(parsed)
        if not deltas and (finish_reason is not None or logprobs is not None):
            deltas = [ChatDelta()]
        for index, delta in enumerate(deltas):
            last = index == len(deltas) - 1
            objects.append(self._chunk(delta, finish_reason if last else None, usage,
                                       logprobs if index == 0 else None))
        return objects

    def usage_object(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[],
                                   usage=usage)

    def whole(self, text: str, finish_reason: str | None, usage: Usage,
              logprobs: Sequence[TokenLogprobs] | None = None) -> BaseModel:
        message = ChatMessageOut(content=text)
        if self.tool_parser is not None:
            parsed = merge_deltas([*self.tool_parser.feed(text), *self.tool_parser.finish()])
            calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments_json))
                     for c in parsed.tool_calls]
            message = ChatMessageOut(content=parsed.content, tool_calls=calls or None)
            if finish_reason is not None:
                finish_reason = tool_calls_finish_reason(finish_reason, len(calls))
        choice = ChatChoice(index=self.index, message=message, finish_reason=finish_reason,
                            logprobs=chat_logprobs(logprobs) if logprobs is not None else None)
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                      choices=[choice], usage=usage)


def _chat_deltas(parsed: Sequence[StreamDelta]) -> list[ChatDelta]:
    """The parser's deltas as chat deltas: runs of content joined, each tool-call piece its own."""
    deltas: list[ChatDelta] = []
    for item in parsed:
        if isinstance(item, ContentDelta):
            if deltas and deltas[-1].tool_calls is None and deltas[-1].content is not None:
                deltas[-1] = ChatDelta(content=deltas[-1].content + item.text)
            elif item.text:
                deltas.append(ChatDelta(content=item.text))
        else:
            deltas.append(ChatDelta(tool_calls=[ToolCallDeltaOut(
                index=item.index, id=item.id, type="function" if item.id is not None else None,
                function=FunctionCallDelta(name=item.name, arguments=item.arguments or None))]))
    return deltas
