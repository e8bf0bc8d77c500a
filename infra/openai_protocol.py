"""OpenAI's completions and chat-completions requests, as pydantic models.

Requests are validated here, at the HTTP edge, so a bad body is refused before it reaches a
worker, with every bad field named (``temperature: Input should be greater than or equal to
0``). The field names and meanings are OpenAI's; ``top_k``, ``stop_token_ids``, ``ignore_eos``
and ``chat_template_kwargs`` are the vLLM extensions clients send through ``extra_body``. Four
kinds of field are told apart on purpose:

- supported: mapped one to one onto `wire.SamplingParams` by `to_sampling_params`, or onto the
  chat's `wire.ChatPrompt` (messages, ``tools``, ``chat_template_kwargs``) by `chat_prompt`;
- known but not served here (``best_of``, which vLLM dropped too; ``suffix``): accepted at their
  neutral value, refused with "not supported" otherwise, so a client never silently gets
  something other than it asked for;
- harmless: accepted and ignored, because they ask nothing of the model's output
  (`IGNORED_FIELDS`: bookkeeping such as ``metadata`` and ``user``, routing hints such as
  ``service_tier`` and ``prompt_cache_key``) -- SDKs and agent frameworks send them routinely;
- unknown: refused by name (``extra="forbid"``), so a typo never falls back to a default.

Numbers are strict (``"0.5"`` and ``true`` are not numbers) and finite (Python's JSON reader
accepts ``NaN``). The response objects are in `openai_responses.py`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from infra.gateway_backend import InvalidRequest, SamplingParams
from wire import MAX_LOGPROBS, MODEL_DEFAULT_FIELDS, ChatPrompt, GrammarSpec

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Most completions one request may ask for (``n``): each is a request of its own on the workers.
MAX_CHOICES = 16
_MAX_SEED_EXCLUSIVE = 2**64

# Fields OpenAI defines that this server does not implement, with the values that mean
# "off" (what SDKs and frameworks send by default).
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
}

# Fields accepted and ignored: none of them changes what the model generates (see the module
# docstring). `user`, `metadata` and `store` are the caller's bookkeeping; `service_tier`,
# `prompt_cache_key` and `safety_identifier` are hints for OpenAI's own routing and abuse
# tracking; `parallel_tool_calls` only permits several calls in one turn, which the tool-call
# formats of the families served here allow or not by themselves (a forced call, tool_choice
# "required", does honour false: exactly one call).
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                  "parallel_tool_calls")
# Template variables a request's chat_template_kwargs may not set: the request itself gives them.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


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
    continuous_usage_stats: bool | None = Field(
        None, strict=True, description="vLLM extension: every chunk carries the usage so far")


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="letters, digits, underscores, dashes")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema object")
    strict: bool | None = Field(None, strict=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema must be given exactly when type is "json_schema"')
        return self

    def grammar(self) -> GrammarSpec | None:
        if self.type == "json_object":
            return GrammarSpec.json_object()
        if self.type == "json_schema":
            # No schema: any JSON value would do, but OpenAI's clients mean an object.
            schema = self.json_schema.schema_ if self.json_schema else None  # type: ignore[union-attr]
            return GrammarSpec.json_schema(schema) if schema is not None else GrammarSpec.json_object()
        return None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (the newer form of its ``guided_*`` fields): one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = Field(None, strict=True)

    def grammar(self) -> GrammarSpec | None:
        given = [name for name in ("json_", "regex", "choice") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) > 1:
            raise ValueError(f"give one constraint, not {len(given)} ({', '.join(g.rstrip('_') for g in given)})")
        if self.json_ is not None:
            return GrammarSpec.json_schema(self.json_)
        if self.regex is not None:
            return GrammarSpec.regex(self.regex)
        if self.choice is not None:
            return GrammarSpec.choice(self.choice)
        return GrammarSpec.json_object() if self.json_object else None


# The request fields that constrain the output, each read into a `GrammarSpec` by its own rule.
_GRAMMAR_FIELDS: dict[str, Any] = {
    "response_format": lambda value: value.grammar(),
    "structured_outputs": lambda value: value.grammar(),
    "guided_json": GrammarSpec.json_schema,
    "guided_regex": GrammarSpec.regex,
    "guided_choice": GrammarSpec.choice,
}


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
    # Accepted and ignored (IGNORED_FIELDS).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = Field(None, strict=True)
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, strict=True, description="completions of the prompt")
    presence_penalty: float | None = _finite(ge=-2.0, le=2.0)
    frequency_penalty: float | None = _finite(ge=-2.0, le=2.0)
    logit_bias: dict[str, Any] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100], added to its logit")
    repetition_penalty: float | None = _finite(gt=0.0, description="vLLM extension; 1 is off")
    min_p: float | None = _finite(ge=0.0, le=1.0, description="vLLM extension; 0 is off")
    min_tokens: int | None = Field(None, ge=0, strict=True, description="vLLM extension")
    skip_special_tokens: bool | None = Field(None, strict=True, description="vLLM extension; default true")
    # Structured output: OpenAI's response_format, or one of vLLM's forms (at most one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM extension: a JSON Schema")
    guided_regex: str | None = Field(None, description="vLLM extension")
    guided_choice: list[str] | None = Field(None, description="vLLM extension")

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

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # Checked here rather than by type: pydantic would name the entry by its key, which for a
        # token id reads like a type and not like a place in the body.
        for key, bias in (value or {}).items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys must be token ids (digits), got {key[:20]!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} must be a number in [-100, 100], got {bias!r}")
        return value

    @field_validator(*_GRAMMAR_FIELDS)
    @classmethod
    def _enforceable(cls, value: Any, info: ValidationInfo) -> Any:
        # The shape only (GrammarSpec's checks); whether the model's grammar engine can enforce
        # it is the worker's to say, when the request is admitted.
        if value is not None:
            _GRAMMAR_FIELDS[info.field_name](value)
        return value

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

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far (``continuous_usage_stats``)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

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
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                min_p=self.min_p or 0.0,
                logit_bias=self.logit_bias or {},
                min_tokens=self.min_tokens or 0,
                logprobs=self._logprobs(),
                skip_special_tokens=self.skip_special_tokens is not False,
                structured_output=self.grammar(),
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

    def grammar_field(self) -> str | None:
        """The structured-output field the request gave, if any (where a refusal points)."""
        return next((name for name in _GRAMMAR_FIELDS if getattr(self, name) is not None), None)

    def grammar(self) -> GrammarSpec | None:
        """What the output must match, from whichever structured-output field was given;
        `InvalidRequest` naming the second one when two are."""
        given = [name for name in _GRAMMAR_FIELDS if getattr(self, name) is not None]
        specs = [(name, _GRAMMAR_FIELDS[name](getattr(self, name))) for name in given]
        specs = [(name, spec) for name, spec in specs if spec is not None]  # response_format "text"
        if len(specs) > 1:
            raise InvalidRequest(f"{specs[1][0]} and {specs[0][0]} both constrain the output; send one of them",
                                 specs[1][0])
        return specs[0][1] if specs else None

    def _logprobs(self) -> int | None:
        """None for no log-probabilities, else how many alternatives per token (each endpoint asks
        its own way)."""
        raise NotImplementedError


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
    # The legacy form: how many alternatives per token; 0 still returns each token's own logprob.
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    echo: bool | None = Field(None, strict=True, description="the prompt's text before the completion's")
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _echo_of_text(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        # The gateway has the text of a text prompt only; echoing token ids, or the prompt's own
        # log-probabilities that echo implies with logprobs, would need the worker.
        if value:
            if info.data.get("logprobs") is not None:
                raise ValueError("together with logprobs is not supported (it asks for the prompt's log-probabilities)")
            prompt = info.data.get("prompt")
            if prompt is not None and not isinstance(prompt, str):
                raise ValueError("is supported for a text prompt only, not for token ids")
        return value

    @field_validator("best_of", "suffix")
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

    def _logprobs(self) -> int | None:
        return self.logprobs

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


class ToolCallFunction(_Strict):
    name: str = Field(min_length=1, max_length=128)
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict):
    """A call the assistant made in an earlier turn (sent back by the client with the history)."""

    id: str = Field(min_length=1, max_length=200)
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def for_template(self) -> dict[str, Any]:
        # Chat templates render the arguments as JSON themselves (Qwen's ``| tojson``); like vLLM,
        # they get the object, not the text, whenever the text is a JSON object.
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system"; chat templates know "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, max_length=200)
    # An earlier turn's reasoning (vLLM's name); templates that show past reasoning read it.
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _unicode(cls, value: str | list[TextContentPart] | None) -> str | list[TextContentPart] | None:
        return _check_text(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls are only allowed on assistant messages, not on a {self.role} message")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only on an assistant message with tool_calls)")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id is only allowed on tool messages, not on a {self.role} message")
        return self

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' form: plain-text content, the
        calls' arguments as objects); fields the client left out stay out."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        text = self.text()
        if text is not None:
            message["content"] = text
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class FunctionDefinition(_Strict):
    # OpenAI's rule for a function's name.
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                      description="letters, digits, underscores, dots and dashes; at most 64")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema object")
    strict: bool | None = Field(None, strict=True)


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: a conversation, rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True, description="accepted and ignored")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM extension: extra variables for the model's chat template, e.g. enable_thinking")

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _free_template_names(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        clashing = sorted(_RESERVED_TEMPLATE_KWARGS & set(value or ()))
        if clashing:
            raise ValueError(f"may not set {', '.join(clashing)}: the request's own fields give them")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _fits_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        if choice is None or choice == "none":
            return choice
        tools = info.data.get("tools")
        if not tools:
            raise ValueError("is only allowed when tools are given")
        if choice == "auto":
            return choice
        if isinstance(choice, NamedToolChoice):
            names = [tool.function.name for tool in tools]
            if choice.function.name not in names:
                raise ValueError(f"names the function {choice.function.name!r}, which is not among the tools "
                                 f"({', '.join(names)})")
        return choice

    @property
    def forced_function(self) -> str | None:
        """The function ``tool_choice`` names, if it names one."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def forces_tool_calls(self) -> bool:
        """Whether ``tool_choice`` requires calls ("required" or a named function): the output is
        then constrained to them (`infra.forced_tool_calls`)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def _max_tokens(self) -> int | None:
        # max_completion_tokens replaced max_tokens in OpenAI's chat API; it wins when both are given.
        return self.max_completion_tokens or self.max_tokens

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_prompt(self) -> ChatPrompt:
        """The chat as a worker renders it: messages in the templates' form, the tools' definitions
        (the template lists them for the model; OpenAI's default ``tool_choice`` "auto" with them,
        and like vLLM with "none" too), and the template's extra variables."""
        return ChatPrompt(
            messages=tuple(m.for_template() for m in self.messages),
            tools=tuple(tool.model_dump(exclude_none=True) for tool in self.tools or ()),
            template_kwargs=dict(self.chat_template_kwargs or {}),
        )

