"""What a request is and what its stream carries: `Prompt` and `GenerationChunk`.

One definition for the gateway, the workers and the migration driver: a worker's stream yields
`GenerationChunk`s, the gateway renders the same records as OpenAI objects, and a stream that
follows a migrated request passes them on. Before this module there were two chunk types (the
worker's named its counts ``num_completion_tokens``, the gateway's ``num_output_tokens`` and
stored ``finished`` beside ``finish_reason``) and three prompt aliases, with a translation between.

Finish reasons are `FinishReason`'s values (``finish_reason`` carries the plain string): "stop",
"length", "abort" (cancelled) and "error" end a request; "suspended" does not -- the instance gave
up its slot (preempted, or stopped) and the gateway continues the request on the model's next
instance -- nor does "migrated", which a following stream continues. A chunk prints without its text (house rule: logs never leak prompts or completions).

A request that asked for log-probabilities (``SamplingParams.logprobs``) gets them in ``logprobs``,
one `TokenLogprobs` per token of ``token_ids``; every other chunk carries None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from wire.chat_prompt import ChatPrompt
from wire.token_logprobs import TokenLogprobs
from wire.wire_record import WireRecord, check_count, check_name, check_optional_seconds, check_token_ids

__all__ = ["ChatMessage", "GenerationChunk", "Prompt"]

# A chat message as `worker.Tokenizer.encode_chat` renders it: {"role": ..., "content": ..., ...}.
ChatMessage = Mapping[str, Any]

# A completion prompt (text or token ids) or a chat: its messages alone, or with tools and
# template arguments (`ChatPrompt`).
Prompt = str | Sequence[int] | Sequence[ChatMessage] | ChatPrompt


@dataclass(frozen=True, kw_only=True)
class GenerationChunk(WireRecord):
    """One piece of a request's stream: the text and tokens added since the previous chunk.

    The last chunk has ``finish_reason`` set (see the module docstring). ``num_prompt_tokens`` /
    ``num_completion_tokens`` are running totals, so on the last chunk they are the request's
    usage. ``queue_s`` is set by the gateway's backend on a request's first chunk: how long it
    waited for a ready instance (None where there is no queue, and on every later chunk).
    ``logprobs``: one `TokenLogprobs` per token of ``token_ids`` for a request that asked for them
    (``SamplingParams.logprobs``), else None. ``num_cached_tokens``: how many of the prompt tokens
    the instance found in its prefix cache instead of computing them (every chunk carries it: what
    OpenAI's ``usage.prompt_tokens_details.cached_tokens`` reports).
    """

    SCHEMA: ClassVar[str] = "generation_chunk/1"

    request_id: str
    text: str = field(repr=False)
    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_prompt_tokens: int
    num_completion_tokens: int
    queue_s: float | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        name = self.record_name()
        check_name(name, "request_id", self.request_id)
        if not isinstance(self.text, str):
            raise ValueError(f"{name}.text must be a string, got {type(self.text).__name__}")
        object.__setattr__(self, "token_ids", check_token_ids(name, "token_ids", self.token_ids))
        check_name(name, "finish_reason", self.finish_reason, optional=True)
        object.__setattr__(self, "num_prompt_tokens", check_count(name, "num_prompt_tokens", self.num_prompt_tokens))
        object.__setattr__(self, "num_completion_tokens",
                           check_count(name, "num_completion_tokens", self.num_completion_tokens))
        object.__setattr__(self, "num_cached_tokens", check_count(name, "num_cached_tokens", self.num_cached_tokens))
        object.__setattr__(self, "queue_s", check_optional_seconds(name, "queue_s", self.queue_s))
        if self.logprobs is not None:
            if not isinstance(self.logprobs, (tuple, list)) \
                    or not all(isinstance(item, TokenLogprobs) for item in self.logprobs):
                raise ValueError(f"{name}.logprobs must be None or a list of TokenLogprobs")
            if len(self.logprobs) != len(self.token_ids):
                raise ValueError(f"{name}.logprobs must have one entry per token: {len(self.logprobs)} for "
                                 f"{len(self.token_ids)} tokens")
            object.__setattr__(self, "logprobs", tuple(self.logprobs))

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> GenerationChunk:
        logprobs = values.get("logprobs")
        if isinstance(logprobs, (tuple, list)):
            items = []
            for i, item in enumerate(logprobs):
                try:
                    items.append(item if isinstance(item, TokenLogprobs) else TokenLogprobs.from_dict(item))
                except ValueError as exc:
                    raise ValueError(f"{cls.record_name()}.logprobs[{i}]: {exc}") from None
            values = {**values, "logprobs": tuple(items)}
        return super().from_fields(values)

    @property
    def finished(self) -> bool:
        """The stream ends with this chunk (a suspended one included: this instance's part ends)."""
        return self.finish_reason is not None
