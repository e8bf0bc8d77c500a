"""`ChatPrompt`: a chat request's prompt as the gateway hands it to a worker.

A chat is more than its messages: the tool definitions the template lists for the model
(``tools``) and the template's own switches (``chat_template_kwargs``, e.g. Qwen3's
``enable_thinking``) change the rendered prompt too, so the three travel together and the worker's
tokenizer renders them in one place (`worker.Tokenizer.encode_prompt`). A bare list of messages
is still a valid `Prompt` (the engine's Python callers use it); it means no tools and no
template arguments.

Messages, tools and arguments are the client's JSON, already validated by the gateway's
protocol models; this record checks only what a worker relies on (a role per message, mappings
where mappings belong), so a record built elsewhere fails here with the field named. A prompt
prints without its content (house rule: logs never leak prompts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from wire.wire_record import WireRecord

__all__ = ["ChatPrompt"]


def _mappings(record: str, name: str, value: object, *, allow_empty: bool) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, (tuple, list)) or (not value and not allow_empty):
        what = "a list of objects" if allow_empty else "a non-empty list of objects"
        raise ValueError(f"{record}.{name} must be {what}, got {type(value).__name__}")
    for index, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise ValueError(f"{record}.{name}[{index}] must be an object, got {type(item).__name__}")
    return tuple(dict(item) for item in value)


@dataclass(frozen=True, kw_only=True)
class ChatPrompt(WireRecord):
    """A chat: messages (``{"role": ..., "content": ..., ...}``), tool definitions (OpenAI's
    ``{"type": "function", "function": {...}}``) and extra chat-template variables."""

    SCHEMA: ClassVar[str] = "chat_prompt/1"

    messages: tuple[dict[str, Any], ...] = field(repr=False)
    tools: tuple[dict[str, Any], ...] = field(default=(), repr=False)
    template_kwargs: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        name = self.record_name()
        messages = _mappings(name, "messages", self.messages, allow_empty=False)
        for index, message in enumerate(messages):
            if not isinstance(message.get("role"), str):
                raise ValueError(f"{name}.messages[{index}].role must be a string")
        object.__setattr__(self, "messages", messages)
        object.__setattr__(self, "tools", _mappings(name, "tools", self.tools, allow_empty=True))
        if not isinstance(self.template_kwargs, Mapping) or not all(isinstance(k, str) for k in self.template_kwargs):
            raise ValueError(f"{name}.template_kwargs must be an object with string keys")
        object.__setattr__(self, "template_kwargs", dict(self.template_kwargs))
