"""OpenAI's response objects (completions, chat completions, their stream chunks, models), as
pydantic models.

They mirror OpenAI's objects field for field so the official clients parse them, and they
document the API in the app's OpenAPI schema. Fields that are optional in OpenAI's stream deltas
are left out rather than sent as null (``exclude_if``), as OpenAI streams them. The renderers that
fill them from a request's `GenerationChunk`s are in `openai_renderers.py`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

__all__ = [
    "ChatChoice", "ChatChunkChoice", "ChatCompletionChunk", "ChatCompletionResponse", "ChatDelta", "ChatLogprobs",
    "ChatMessageOut", "ChatTokenLogprob", "CompletionChoice", "CompletionLogprobs", "CompletionResponse",
    "FunctionCallDelta", "FunctionCallOut", "ModelList", "ModelObject", "PromptTokensDetails", "ToolCallDeltaOut",
    "ToolCallOut", "TopLogprob",
    "Usage",
]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens the worker's prefix cache served


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Only when the prefix cache served part of the prompt (as vLLM, which sends it only on request).
    prompt_tokens_details: PromptTokensDetails | None = Field(None, exclude_if=lambda v: v is None)

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> Usage:
        details = PromptTokensDetails(cached_tokens=num_cached_tokens) if num_cached_tokens else None
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens, prompt_tokens_details=details)


class CompletionLogprobs(BaseModel):
    """The legacy completions form: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]  # where each token starts in the completion's text


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, and (with ``object`` the same) one streamed chunk of one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the reply is tool calls only
    tool_calls: list[ToolCallOut] | None = Field(None, exclude_if=lambda v: v is None)


class FunctionCallDelta(BaseModel):
    # The name comes once, in a call's first delta; the arguments' JSON text in pieces after it.
    name: str | None = Field(None, exclude_if=lambda v: v is None)
    arguments: str | None = Field(None, exclude_if=lambda v: v is None)


class ToolCallDeltaOut(BaseModel):
    index: int
    id: str | None = Field(None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(None, exclude_if=lambda v: v is None)
    function: FunctionCallDelta


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    # Absent rather than null when unset, as OpenAI streams them: role only in the first delta.
    role: Literal["assistant"] | None = Field(None, exclude_if=lambda v: v is None)
    content: str | None = Field(None, exclude_if=lambda v: v is None)
    tool_calls: list[ToolCallDeltaOut] | None = Field(None, exclude_if=lambda v: v is None)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]
