"""OpenAI's completions and chat-completions wire format, as pydantic models.

Requests are validated here, at the HTTP edge, so a bad body is refused before it reaches a
worker, with every bad field named (``temperature: Input should be greater than or equal to
0``). The field names and meanings are OpenAI's; ``top_k``, ``stop_token_ids`` and
``ignore_eos`` are the vLLM extensions clients send through ``extra_body``. Three kinds of
field are told apart on purpose:

- supported: mapped one to one onto `wire.SamplingParams` by `to_sampling_params`;
- known to OpenAI but not served here (``n > 1``, ``logprobs``, penalties, tools): accepted at
  their neutral value, refused with "not supported" otherwise, so a client never silently
  gets something other than it asked for;
- unknown: refused by name (``extra="forbid"``), so a typo never falls back to a default.

Numbers are strict (``"0.5"`` and ``true`` are not numbers) and finite (Python's JSON reader
accepts ``NaN``). Response models mirror OpenAI's objects so the official clients parse them;
they also document the API in the app's OpenAPI schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from infra.gateway_backend import GenerationChunk, InvalidRequest, SamplingParams
from wire import MODEL_DEFAULT_FIELDS

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_MAX_SEED_EXCLUSIVE = 2**64

# Fields OpenAI defines that this server does not implement, with the values that mean
# "off" (what SDKs and frameworks send by default).
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


def _check_text(value: str) -> str:
    # JSON may escape a lone UTF-16 surrogate ("\\ud800"); no tokenizer can encode that.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it contains a lone surrogate)") from None
    return value


class _Strict(BaseModel):
    """Unknown fields are errors, named in the response."""

    model_config = ConfigDict(extra="forbid")


def _finite(default: float | None = None, **constraints: Any) -> Any:
    return Field(default, strict=True, allow_inf_nan=False, **constraints)


class StreamOptions(_Strict):
    include_usage: bool | None = Field(None, strict=True)


class _GenerationRequest(_Strict):
    """Fields shared by both endpoints."""

    # Optional on per-model routes (the model is in the URL); the app requires it elsewhere.
    model: str | None = Field(None, min_length=1, max_length=200)
    max_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float | None = _finite(ge=0.0)
    top_p: float | None = _finite(gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, strict=True, description="0 or -1 disables it (vLLM)")
    seed: int | None = Field(None, ge=0, lt=_MAX_SEED_EXCLUSIVE, strict=True)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="vLLM extension")
    ignore_eos: bool | None = Field(None, strict=True, description="vLLM extension")
    stream: bool | None = Field(None, strict=True)
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = Field(None, strict=True)
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = _finite()
    frequency_penalty: float | None = _finite()

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        for stop in stops:
            _check_text(stop)
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(isinstance(t, bool) or t < 0 for t in value):
            raise ValueError("token ids must be integers >= 0")
        return value

    @field_validator("n", "logprobs", "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty")
    @classmethod
    def _not_served(cls, value: Any, info: ValidationInfo) -> Any:
        return _require_neutral(value, info)

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("is only allowed with stream: true")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's settings for this request; `InvalidRequest` names the field if they clash."""
        try:
            return SamplingParams(
                max_tokens=self._max_tokens() or default_max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=max(self.top_k or 0, 0),
                top_p=1.0 if self.top_p is None else self.top_p,
                seed=self.seed,
                stop=() if self.stop is None else self.stop,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=bool(self.ignore_eos),
                # Left out: the model's generation_config.json may set them (applied by the worker).
                model_defaults=tuple(name for name in MODEL_DEFAULT_FIELDS if getattr(self, name) is None),
            )
        except ValueError as exc:
            # SamplingParams' messages start with the field's name ("top_p must be ...").
            message = str(exc)
            field_name = message.split(" ", 1)[0].split("[", 1)[0]
            raise InvalidRequest(message, field_name if field_name in type(self).model_fields else None) from None

    def _max_tokens(self) -> int | None:
        return self.max_tokens


def _require_neutral(value: Any, info: ValidationInfo) -> Any:
    """Accepts a field this server does not implement only at its "off" value."""
    allowed = _NEUTRAL_VALUES[info.field_name]
    if value not in allowed:
        alternative = f" or send {allowed[1]!r}" if len(allowed) > 1 else ""
        raise ValueError(f"is not supported by this server; leave it out{alternative}")
    return value


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo", "best_of", "suffix")
    @classmethod
    def _not_served_here(cls, value: Any, info: ValidationInfo) -> Any:
        return _require_neutral(value, info)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        # SDKs send a batch as a list of prompts; a batch of one is just that prompt.
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(f"batched prompts are not supported: send one prompt per request, got {len(value)}")
            value = value[0]
        if not value:
            raise ValueError("must not be empty")
        if isinstance(value, str):
            return _check_text(value)
        if any(isinstance(t, bool) or t < 0 for t in value):
            raise ValueError("token ids must be integers >= 0")
        return value

    def prompt_input(self) -> str | list[int]:
        """The prompt as the backend takes it (validation left exactly one)."""
        return self.prompt  # type: ignore[return-value]


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _unicode(cls, value: str) -> str:
        return _check_text(value)


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system"; chat templates know "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _unicode(cls, value: str | list[TextContentPart]) -> str | list[TextContentPart]:
        return _check_text(value) if isinstance(value, str) else value

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: a conversation, rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("tools", "tool_choice", "response_format")
    @classmethod
    def _not_served_here(cls, value: Any, info: ValidationInfo) -> Any:
        return _require_neutral(value, info)

    def _max_tokens(self) -> int | None:
        # max_completion_tokens replaced max_tokens in OpenAI's chat API; it wins when both are given.
        return self.max_completion_tokens or self.max_tokens

    def prompt_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them: role + plain-text content."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages
        ]


# ---- responses ---------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int) -> Usage:
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, and (with ``object`` the same) one streamed chunk of one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
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


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
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


# ---- rendering engine chunks as OpenAI objects -------------------------------------------------


@dataclass(frozen=True)
class CompletionRenderer:
    """Turns one request's `GenerationChunk`s into ``text_completion`` objects."""

    request_id: str
    model: str
    created: int

    def stream_objects(self, chunk: GenerationChunk, is_first: bool) -> list[BaseModel]:
        if not chunk.text and not chunk.finished:
            return []  # a token that completes no character yet (part of a UTF-8 sequence)
        choice = CompletionChoice(text=chunk.text, finish_reason=chunk.finish_reason if chunk.finished else None)
        return [CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[choice])]

    def usage_object(self, usage: Usage) -> BaseModel:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage)

    def whole(self, text: str, finish_reason: str | None, usage: Usage) -> BaseModel:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                                  usage=usage)


@dataclass(frozen=True)
class ChatRenderer:
    """Turns one request's `GenerationChunk`s into ``chat.completion(.chunk)`` objects."""

    request_id: str
    model: str
    created: int

    def _chunk(self, delta: ChatDelta, finish_reason: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)])

    def stream_objects(self, chunk: GenerationChunk, is_first: bool) -> list[BaseModel]:
        # Like OpenAI: the first chunk announces the role with empty content.
        objects: list[BaseModel] = [self._chunk(ChatDelta(role="assistant", content=""))] if is_first else []
        if chunk.text or chunk.finished:
            objects.append(self._chunk(ChatDelta(content=chunk.text or None),
                                       chunk.finish_reason if chunk.finished else None))
        return objects

    def usage_object(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[],
                                   usage=usage)

    def whole(self, text: str, finish_reason: str | None, usage: Usage) -> BaseModel:
        choice = ChatChoice(message=ChatMessageOut(content=text), finish_reason=finish_reason)
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                      choices=[choice], usage=usage)
