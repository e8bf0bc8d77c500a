"""Tool calls read out of a chat model's generated text, whole or streamed, as OpenAI wants them.

Open chat models call tools by writing text in a format their chat template taught them; an
OpenAI client expects ``tool_calls`` with an id, a name and the arguments as a JSON string, and,
when streaming, ``delta.tool_calls`` fragments with the name first and the arguments in pieces.
This module turns one into the other for the families Thaw serves (the formats vLLM calls by the
same names, reimplemented here without a tokenizer):

- ``"hermes"`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>``, any number of them; text before them (Qwen3's ``<think>...</think>`` too) is
  content.
- ``"llama3_json"`` (Llama 3.1-3.3): the whole output is ``{"name": ..., "parameters": {...}}``
  (or ``"arguments"``), optionally after ``<|python_tag|>``, several joined by ``;``.
- ``"mistral"``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` and the newer
  ``[TOOL_CALLS]name[ARGS]{...}``. Ids are 9 letters and digits, the only ids Mistral's chat
  templates accept when the client sends the calls back; the other formats get ``call_`` + 24
  hex digits.

`ToolCallStreamParser` reads the text as it is generated (`feed` each new piece, then `finish`)
and returns `ContentDelta`s and `ToolCallDelta`s; `parse_tool_calls` reads a whole text and is
that same parser fed once, so a streamed response and a whole one always agree, however the
text was split. Both are pure: ids come from the `random.Random` the caller passes.

The rules the streaming parser keeps, character by character (the JSON is checked by
`infra.tool_call_json`):
- Text that may still become a tool call (a partial ``<tool_`` marker, a marker and a JSON object
  not yet shown to be a call) is held back, never sent as content and taken back.
- A call is decided once its name is complete and its arguments object has begun. Its first
  delta then carries the id and the name, and the arguments follow verbatim as they arrive.
- Text that turns out not to be a call (invalid JSON, a key other than the name and arguments, a
  missing name) is content, marker included; nothing is raised at the client (as vLLM does).
  After a call was decided nothing can be taken back: if the model then breaks the JSON, the
  call keeps the arguments sent so far and the rest of the text is content; if the output ends
  inside the arguments (``max_tokens``), the call keeps them truncated, as OpenAI does, and
  `tool_calls_finish_reason` leaves ``"length"``.
- Whitespace that only separates tool calls (or precedes the first) is dropped; an output
  without tool calls comes back as content unchanged.

Special tokens must reach the parser: ``[TOOL_CALLS]`` is a special token in Mistral's
tokenizers, so its text is lost if detokenizing skips special tokens. ``<tool_call>`` (Qwen) is
not special, and ``<|python_tag|>`` is optional.
"""

from __future__ import annotations

import enum
import random
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from infra.tool_call_json import JsonScanner, ObjectEvent, ScanStatus, ToolCallObjectScanner
# The format names and their detection are shared with the controller, which resolves a deploy's
# "auto" (wire/tool_call_format.py); re-exported here with the parsers.
from wire import TOOL_CALL_FORMATS, detect_tool_call_format

__all__ = [
    "TOOL_CALL_FORMATS",
    "ContentDelta",
    "ParsedOutput",
    "ParsedToolCall",
    "StreamDelta",
    "ToolCallDelta",
    "ToolCallStreamParser",
    "detect_tool_call_format",
    "merge_deltas",
    "parse_tool_calls",
    "tool_calls_finish_reason",
]

_WHITESPACE = frozenset(" \t\n\r")
_ALPHANUMERIC = string.ascii_letters + string.digits
_MISTRAL_NAME_CHARS = frozenset(_ALPHANUMERIC + "_-.")


@dataclass(frozen=True)
class ParsedToolCall:
    """One tool call: OpenAI's ``id``, ``function.name`` and ``function.arguments``."""

    id: str
    name: str
    arguments_json: str = field(repr=False)  # JSON text of an object, as the model wrote it


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output read: the message's content (None when empty) and its tool calls."""

    content: str | None = field(repr=False)
    tool_calls: tuple[ParsedToolCall, ...]


@dataclass(frozen=True)
class ContentDelta:
    """Text to send as ``delta.content``."""

    text: str = field(repr=False)


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of ``delta.tool_calls[0]``: the call's first delta has its id and name; the
    arguments (possibly empty on the first) are the next fragment of the arguments' JSON text."""

    index: int
    id: str | None
    name: str | None
    arguments: str = field(repr=False)


StreamDelta = ContentDelta | ToolCallDelta


def tool_calls_finish_reason(finish_reason: str, num_tool_calls: int) -> str:
    """OpenAI's ``finish_reason`` for a choice: ``"tool_calls"`` when the model stopped after
    calling tools; any other reason (``"length"``: the last call may be cut short) is kept."""
    return "tool_calls" if num_tool_calls > 0 and finish_reason == "stop" else finish_reason


def parse_tool_calls(text: str, tool_call_format: str, rng: random.Random) -> ParsedOutput:
    """A whole output's content and tool calls (exactly what streaming `text` would send)."""
    parser = ToolCallStreamParser(tool_call_format, rng)
    return merge_deltas([*parser.feed(text), *parser.finish()])


def merge_deltas(deltas: Iterable[StreamDelta]) -> ParsedOutput:
    """What a client assembles from streamed deltas: content joined, each call's arguments joined."""
    content: list[str] = []
    calls: list[ParsedToolCall] = []
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content.append(delta.text)
        elif delta.id is not None and delta.name is not None:
            if delta.index != len(calls):
                raise ValueError(f"tool call {delta.index} started after {len(calls)} calls; "
                                 "deltas must come in the order the parser sent them")
            calls.append(ParsedToolCall(delta.id, delta.name, delta.arguments))
        else:
            if delta.index >= len(calls):
                raise ValueError(f"arguments for tool call {delta.index} before its first delta; "
                                 "deltas must come in the order the parser sent them")
            call = calls[delta.index]
            calls[delta.index] = replace(call, arguments_json=call.arguments_json + delta.arguments)
    return ParsedOutput(content="".join(content) or None, tool_calls=tuple(calls))


class ToolCallStreamParser:
    """Reads one generated output, piece by piece, into content and tool-call deltas.

    `feed` takes each new piece of text and returns what can be sent now; `finish` returns what
    was held back at the end. One parser serves one choice of one request.
    """

    def __init__(self, tool_call_format: str, rng: random.Random) -> None:
        if tool_call_format == "hermes":
            self._grammar: _Grammar = _HermesGrammar(lambda: _openai_call_id(rng))
        elif tool_call_format == "llama3_json":
            self._grammar = _Llama3JsonGrammar(lambda: _openai_call_id(rng))
        elif tool_call_format == "mistral":
            self._grammar = _MistralGrammar(lambda: _mistral_call_id(rng))
        else:
            raise ValueError(f"unknown tool-call format {tool_call_format!r}; "
                             f"use one of {', '.join(TOOL_CALL_FORMATS)}")
        self._finished = False
        self.tool_call_format = tool_call_format

    @property
    def needs_special_tokens(self) -> bool:
        """Whether the output must keep its special tokens' text for this parser: Mistral's
        ``[TOOL_CALLS]`` is a special token (see the module docstring)."""
        return self.tool_call_format == "mistral"

    @property
    def num_tool_calls(self) -> int:
        """Calls started so far (each has sent its first delta)."""
        return self._grammar.num_tool_calls

    def feed(self, text: str) -> list[StreamDelta]:
        if self._finished:
            raise ValueError("feed() after finish(): start a new ToolCallStreamParser per output")
        self._grammar.feed(text)
        return self._grammar.out.take()

    def finish(self) -> list[StreamDelta]:
        if self._finished:
            raise ValueError("finish() called twice: start a new ToolCallStreamParser per output")
        self._finished = True
        self._grammar.finish()
        return self._grammar.out.take()


def _openai_call_id(rng: random.Random) -> str:
    return f"call_{rng.getrandbits(96):024x}"


def _mistral_call_id(rng: random.Random) -> str:
    return "".join(rng.choice(_ALPHANUMERIC) for _ in range(9))


class _DeltaBuffer:
    """Collects per-character output and joins neighbours of the same kind into one delta."""

    def __init__(self) -> None:
        self._deltas: list[StreamDelta] = []
        self._parts: list[str] = []
        self._call_index: int | None = None  # None: the parts are content
        self._call_start: tuple[str, str] | None = None  # (id, name) for the call's first delta

    def content(self, text: str) -> None:
        if self._call_index is not None:
            self._flush()
        self._parts.append(text)

    def call_start(self, index: int, call_id: str, name: str, arguments: str) -> None:
        self._flush()
        self._call_index, self._call_start = index, (call_id, name)
        self._parts.append(arguments)

    def arguments(self, index: int, text: str) -> None:
        if self._call_index != index:
            self._flush()
            self._call_index = index
        self._parts.append(text)

    def take(self) -> list[StreamDelta]:
        self._flush()
        deltas, self._deltas = self._deltas, []
        return deltas

    def _flush(self) -> None:
        text = "".join(self._parts)
        if self._call_index is None:
            if text:
                self._deltas.append(ContentDelta(text))
        elif self._call_start is not None:
            call_id, name = self._call_start
            self._deltas.append(ToolCallDelta(self._call_index, call_id, name, text))
        elif text:
            self._deltas.append(ToolCallDelta(self._call_index, None, None, text))
        self._parts, self._call_index, self._call_start = [], None, None


class _State(enum.Enum):
    TEXT = enum.auto()  # content, watching for the format's marker
    PLAIN = enum.auto()  # content to the end (llama3_json: the output is not a call)
    START = enum.auto()  # llama3_json: before the first object
    OBJECT = enum.auto()  # inside a tool-call object
    CLOSE = enum.auto()  # hermes: after an object, before </tool_call>
    AFTER = enum.auto()  # llama3_json: after an object, before ";"
    NEXT = enum.auto()  # llama3_json: after ";", before the next object
    AFTER_MARKER = enum.auto()  # mistral: after [TOOL_CALLS]
    ARRAY_START = enum.auto()  # mistral: after "[", before the first object
    ARRAY_AFTER = enum.auto()  # mistral: after an object in the array
    ARRAY_NEXT = enum.auto()  # mistral: after ",", before the next object
    NAME = enum.auto()  # mistral: [TOOL_CALLS]name...
    ARGS_TAG = enum.auto()  # mistral: inside [ARGS]
    ARGS = enum.auto()  # mistral: the arguments object after [ARGS]


class _Grammar:
    """What the formats share: the text held back, the call being streamed, the output.

    `_held` is text not yet decided. `_held_is_trailer` marks it as what follows a finished call
    (whitespace, separators, a closing tag), dropped if the output ends there; otherwise it is
    content if the output ends or it turns out not to be a call, and dropped when it becomes one.
    """

    _fallback = _State.TEXT  # where text that is not a call continues
    _arguments_keys = frozenset({"arguments"})
    _ignored_keys: frozenset[str] = frozenset()

    def __init__(self, new_call_id: Callable[[], str]) -> None:
        self._new_call_id = new_call_id
        self.out = _DeltaBuffer()
        self.num_tool_calls = 0
        self._state = _State.TEXT
        self._held = ""
        self._held_is_trailer = False
        self._streaming_call = False  # a call's first delta was sent and its text goes on
        self._early_arguments = ""  # arguments read before the name (not sent yet)
        self._object = ToolCallObjectScanner(self._arguments_keys, self._ignored_keys)

    def feed(self, text: str) -> None:
        for char in text:
            self._push(char)

    def finish(self) -> None:
        if not self._streaming_call and not self._held_is_trailer:
            self._content(self._held)
        self._held = ""

    def _push(self, char: str) -> None:
        raise NotImplementedError

    def _content(self, text: str) -> None:
        if text:
            self.out.content(text)

    def _begin_object(self) -> None:
        self._object = ToolCallObjectScanner(self._arguments_keys, self._ignored_keys)
        self._held_is_trailer = False

    def _push_object(self, char: str) -> bool:
        """Feeds the object; True when `char` closed it (the call is complete)."""
        event = self._object.push(char)
        if event is ObjectEvent.ERROR:
            self._fail(char)
            return False
        if self._streaming_call:
            if event is ObjectEvent.ARGUMENTS:
                self._arguments(char)
        else:
            self._held += char
            if event is ObjectEvent.ARGUMENTS:
                self._early_arguments += char
            if self._object.name is not None and self._object.arguments_started:
                self._start_call(self._object.name, self._early_arguments)
        if event is ObjectEvent.DONE:
            self._end_call()
            return True
        return False

    def _start_call(self, name: str, arguments: str) -> None:
        self.out.call_start(self.num_tool_calls, self._new_call_id(), name, arguments)
        self.num_tool_calls += 1
        self._streaming_call = True
        self._held, self._early_arguments = "", ""

    def _arguments(self, text: str) -> None:
        self.out.arguments(self.num_tool_calls - 1, text)

    def _end_call(self) -> None:
        self._streaming_call = False
        self._held, self._held_is_trailer = "", True

    def _fail(self, char: str) -> None:
        """The held text is not a call (or a started call's text broke off): it is content, and
        `char` is read again as content."""
        self._content(self._held)
        self._held, self._held_is_trailer = "", False
        self._streaming_call, self._early_arguments = False, ""
        self._state = self._fallback
        self._push(char)


class _MarkedGrammar(_Grammar):
    """Formats whose calls start at a marker anywhere in the text (hermes, mistral)."""

    _marker = ""

    def __init__(self, new_call_id: Callable[[], str]) -> None:
        super().__init__(new_call_id)
        self._partial = ""  # the end of the text, while it is a proper prefix of the marker
        self._gap = ""  # whitespace after the last call (or at the start), droppable
        self._in_gap = True

    def feed(self, text: str) -> None:
        i, first = 0, self._marker[0]
        while i < len(text):
            if self._state is _State.TEXT and not self._partial and not self._in_gap:
                end = text.find(first, i)
                end = len(text) if end < 0 else end
                if end > i:  # plain text: nothing here can start the marker
                    self._content(text[i:end])
                    i = end
                    continue
            self._push(text[i])
            i += 1

    def finish(self) -> None:
        if self._state is _State.TEXT:
            if self._partial or self.num_tool_calls == 0:
                self._content(self._gap + self._partial)
            self._gap = self._partial = ""
        super().finish()

    def _content(self, text: str) -> None:
        if text:
            self._in_gap = False
            self.out.content(text)

    def _push_text(self, char: str) -> bool:
        """Content, watching for the marker; True when `char` completed it (now held)."""
        if self._in_gap and not self._partial and char in _WHITESPACE:
            self._gap += char
            return False
        candidate = self._partial + char
        if candidate == self._marker:
            self._held, self._gap, self._partial = self._gap + candidate, "", ""
            self._held_is_trailer = False
            return True
        # Keep the longest end of the text that may still begin the marker.
        start = next(s for s in range(len(candidate) + 1) if self._marker.startswith(candidate[s:]))
        self._partial = candidate[start:]
        if start > 0:
            gap, self._gap = self._gap, ""
            self._content(gap + candidate[:start])
        return False

    def _end_call_text(self) -> None:
        """Back to content after a call; whitespace until the next marker is dropped."""
        self._held = ""
        self._state, self._in_gap = _State.TEXT, True


class _HermesGrammar(_MarkedGrammar):
    _marker = "<tool_call>"
    _close = "</tool_call>"

    def __init__(self, new_call_id: Callable[[], str]) -> None:
        super().__init__(new_call_id)
        self._tag = ""  # what was read of </tool_call> (or of a new <tool_call>) after a call

    def _push(self, char: str) -> None:
        state = self._state
        if state is _State.TEXT:
            if self._push_text(char):
                self._begin_object()
                self._state = _State.OBJECT
        elif state is _State.OBJECT:
            if self._push_object(char):
                self._state, self._tag = _State.CLOSE, ""
        elif not self._tag and char in _WHITESPACE:
            self._held += char
        else:
            tag = self._tag + char
            if self._close.startswith(tag) or self._marker.startswith(tag):
                self._held += char
                self._tag = tag
                if tag == self._close:
                    self._end_call_text()
                elif tag == self._marker:  # the model opened a new call without closing one
                    self._begin_object()
                    self._state = _State.OBJECT
            else:
                self._fail(char)


class _Llama3JsonGrammar(_Grammar):
    _fallback = _State.PLAIN
    _arguments_keys = frozenset({"arguments", "parameters"})
    _python_tag = "<|python_tag|>"

    def __init__(self, new_call_id: Callable[[], str]) -> None:
        super().__init__(new_call_id)
        self._state = _State.START
        self._tag_read = 0  # characters of <|python_tag|> read

    def feed(self, text: str) -> None:
        for i, char in enumerate(text):
            if self._state is _State.PLAIN:  # not a call: the rest is content
                self._content(text[i:])
                return
            self._push(char)

    def _push(self, char: str) -> None:
        state = self._state
        if state is _State.PLAIN:
            self._content(char)
        elif state is _State.OBJECT:
            if self._push_object(char):
                self._state = _State.AFTER
        elif state is _State.START and 0 < self._tag_read < len(self._python_tag):
            if char != self._python_tag[self._tag_read]:
                self._fail(char)
            else:
                self._held += char
                self._tag_read += 1
        elif char in _WHITESPACE:
            self._held += char
        elif char == "{" and state is not _State.AFTER:  # START or NEXT
            self._begin_object()
            self._state = _State.OBJECT
            self._push_object(char)
        elif state is _State.START and self._tag_read == 0 and char == self._python_tag[0]:
            self._held += char
            self._tag_read = 1
        elif state is _State.AFTER and char == ";":
            self._held += char
            self._state = _State.NEXT
        else:
            self._fail(char)


class _MistralGrammar(_MarkedGrammar):
    _marker = "[TOOL_CALLS]"
    _args_tag = "[ARGS]"
    _ignored_keys = frozenset({"id"})  # Mistral's templates write the call id into the object

    def __init__(self, new_call_id: Callable[[], str]) -> None:
        super().__init__(new_call_id)
        self._name = ""
        self._tag_read = 0
        self._arguments_json = JsonScanner()

    def _push(self, char: str) -> None:
        state = self._state
        if state is _State.TEXT:
            if self._push_text(char):
                self._state = _State.AFTER_MARKER
        elif state is _State.OBJECT:
            if self._push_object(char):
                self._state = _State.ARRAY_AFTER
        elif state is _State.ARGS:
            status = self._arguments_json.push(char)
            if status is ScanStatus.ERROR:
                self._fail(char)
                return
            self._arguments(char)
            if status is ScanStatus.DONE:
                self._end_call()
                self._end_call_text()
        elif state is _State.NAME:
            self._held += char
            if char == "[":
                self._state, self._tag_read = _State.ARGS_TAG, 1
            elif char in _MISTRAL_NAME_CHARS:
                self._name += char
            else:
                self._fail_held(char)
        elif state is _State.ARGS_TAG:
            if self._tag_read == len(self._args_tag):
                if char != "{":
                    self._fail(char)
                    return
                self._start_call(self._name, char)
                self._arguments_json = JsonScanner()
                self._arguments_json.push(char)
                self._state = _State.ARGS
            elif char == self._args_tag[self._tag_read]:
                self._held += char
                self._tag_read += 1
            else:
                self._fail(char)
        elif char in _WHITESPACE:
            self._held += char
        elif state is _State.AFTER_MARKER:
            self._held += char
            if char == "[":
                self._state = _State.ARRAY_START
            elif char in _MISTRAL_NAME_CHARS:
                self._state, self._name = _State.NAME, char
            else:
                self._fail_held(char)
        elif char == "{" and state is not _State.ARRAY_AFTER:  # ARRAY_START or ARRAY_NEXT
            self._begin_object()
            self._state = _State.OBJECT
            self._push_object(char)
        elif state is _State.ARRAY_AFTER and char == ",":
            self._held += char
            self._state = _State.ARRAY_NEXT
        elif state is _State.ARRAY_AFTER and char == "]":
            self._end_call_text()
        else:
            self._fail(char)

    def _fail_held(self, char: str) -> None:
        """`char` was already held: the held text, with it, is content."""
        self._held = self._held[:-1]
        self._fail(char)
