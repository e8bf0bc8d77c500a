"""Strict JSON checked one character at a time, for tool calls a model writes as text.

A chat model writes a tool call as text (``{"name": "get_weather", "arguments": {"city": ...}}``)
and the gateway streams it to the client as it is generated. Streaming the arguments while they
arrive, and never streaming text that later turns out not to be a tool call, both need to know
after every character whether what came so far can still be valid JSON. Parsing the whole
buffer again at each token (vLLM's ``partial_json_parser`` approach) costs O(n^2) and needs a
lenient parser; these scanners keep a small stack instead and answer per character, in O(1).

`JsonScanner` checks one JSON value (RFC 8259, nothing lenient: no single quotes, no trailing
commas, no NaN). `ToolCallObjectScanner` uses it to read the object a tool call is written as,
reports the function's name once its string is complete, marks which characters belong to the
arguments object (those are streamed to the client verbatim), and rejects the object as soon as
it cannot be a tool call. `infra.tool_call_parser` drives both.
"""

from __future__ import annotations

import enum
import json

__all__ = ["JsonScanner", "ObjectEvent", "ScanStatus", "ToolCallObjectScanner"]

_WHITESPACE = frozenset(" \t\n\r")
_DIGITS = frozenset("0123456789")
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset('"\\/bfnrt')
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}


class ScanStatus(enum.Enum):
    MORE = "more"  # the character was accepted; the value is not complete yet
    DONE = "done"  # the character completed the value
    ENDED = "ended"  # the value (a number) ended before this character, which was not consumed
    ERROR = "error"  # the character cannot continue a valid JSON value


class _Mode(enum.Enum):
    VALUE = enum.auto()  # a value must start (whitespace allowed)
    VALUE_OR_CLOSE = enum.auto()  # just after "[": a value or "]"
    KEY_OR_CLOSE = enum.auto()  # just after "{": a key or "}"
    KEY = enum.auto()  # after "," in an object: a key
    COLON = enum.auto()
    AFTER_VALUE = enum.auto()  # inside a container after a value: "," or its closing bracket
    STRING = enum.auto()
    ESCAPE = enum.auto()  # after a backslash in a string
    UNICODE = enum.auto()  # inside the four hex digits of a \\u escape
    NUMBER = enum.auto()
    LITERAL = enum.auto()  # inside true / false / null
    DONE = enum.auto()
    FAILED = enum.auto()


class _Num(enum.Enum):
    MINUS = enum.auto()
    ZERO = enum.auto()
    INT = enum.auto()
    DOT = enum.auto()
    FRAC = enum.auto()
    EXP = enum.auto()
    EXP_SIGN = enum.auto()
    EXP_DIGITS = enum.auto()


# Number states in which the number may end (the next character is not part of it).
_NUMBER_MAY_END = frozenset({_Num.ZERO, _Num.INT, _Num.FRAC, _Num.EXP_DIGITS})


class JsonScanner:
    """Checks that a stream of characters is one valid JSON value, character by character.

    `push` answers for each character whether the text so far is still a prefix of some valid
    value, and when the value is complete. Leading whitespace is accepted; the scanner stops at
    the end of the value (text after it is the caller's).
    """

    def __init__(self) -> None:
        self._stack: list[str] = []  # open containers, "{" or "["
        self._mode = _Mode.VALUE
        self._string_is_key = False
        self._literal_rest = ""
        self._num = _Num.MINUS
        self._hex_left = 0

    @property
    def done(self) -> bool:
        return self._mode is _Mode.DONE

    def push(self, char: str) -> ScanStatus:
        mode = self._mode
        if mode is _Mode.STRING:
            if char == '"':
                if self._string_is_key:
                    self._mode = _Mode.COLON
                    return ScanStatus.MORE
                return self._value_ended()
            if char == "\\":
                self._mode = _Mode.ESCAPE
            elif char < " ":
                return self._fail()
            return ScanStatus.MORE
        if mode is _Mode.ESCAPE:
            if char in _SIMPLE_ESCAPES:
                self._mode = _Mode.STRING
            elif char == "u":
                self._mode, self._hex_left = _Mode.UNICODE, 4
            else:
                return self._fail()
            return ScanStatus.MORE
        if mode is _Mode.UNICODE:
            if char not in _HEX_DIGITS:
                return self._fail()
            self._hex_left -= 1
            if self._hex_left == 0:
                self._mode = _Mode.STRING
            return ScanStatus.MORE
        if mode is _Mode.NUMBER:
            return self._push_number(char)
        if mode is _Mode.LITERAL:
            if char != self._literal_rest[0]:
                return self._fail()
            self._literal_rest = self._literal_rest[1:]
            return self._value_ended() if not self._literal_rest else ScanStatus.MORE
        if char in _WHITESPACE and mode is not _Mode.DONE and mode is not _Mode.FAILED:
            return ScanStatus.MORE
        if mode is _Mode.VALUE:
            return self._start_value(char)
        if mode is _Mode.VALUE_OR_CLOSE:
            return self._close() if char == "]" else self._start_value(char)
        if mode is _Mode.KEY_OR_CLOSE or mode is _Mode.KEY:
            if char == '"':
                self._mode, self._string_is_key = _Mode.STRING, True
                return ScanStatus.MORE
            if char == "}" and mode is _Mode.KEY_OR_CLOSE:
                return self._close()
            return self._fail()
        if mode is _Mode.COLON:
            if char != ":":
                return self._fail()
            self._mode = _Mode.VALUE
            return ScanStatus.MORE
        if mode is _Mode.AFTER_VALUE:
            top = self._stack[-1]
            if char == ",":
                self._mode = _Mode.KEY if top == "{" else _Mode.VALUE
                return ScanStatus.MORE
            if (char == "}" and top == "{") or (char == "]" and top == "["):
                return self._close()
            return self._fail()
        return self._fail()  # DONE or FAILED: nothing may follow

    def _start_value(self, char: str) -> ScanStatus:
        if char == "{" or char == "[":
            self._stack.append(char)
            self._mode = _Mode.KEY_OR_CLOSE if char == "{" else _Mode.VALUE_OR_CLOSE
        elif char == '"':
            self._mode, self._string_is_key = _Mode.STRING, False
        elif char == "-" or char in _DIGITS:
            self._mode = _Mode.NUMBER
            self._num = _Num.MINUS if char == "-" else _Num.ZERO if char == "0" else _Num.INT
        elif char in _LITERALS:
            self._mode, self._literal_rest = _Mode.LITERAL, _LITERALS[char]
        else:
            return self._fail()
        return ScanStatus.MORE

    def _push_number(self, char: str) -> ScanStatus:
        num = self._num
        is_digit = char in _DIGITS
        if num is _Num.MINUS:
            nxt = (_Num.ZERO if char == "0" else _Num.INT) if is_digit else None
        elif num is _Num.ZERO or num is _Num.INT:
            if is_digit:
                nxt = _Num.INT if num is _Num.INT else None  # no leading zeros
            else:
                nxt = _Num.DOT if char == "." else _Num.EXP if char in "eE" else None
        elif num is _Num.DOT:
            nxt = _Num.FRAC if is_digit else None
        elif num is _Num.FRAC:
            nxt = _Num.FRAC if is_digit else _Num.EXP if char in "eE" else None
        elif num is _Num.EXP:
            nxt = _Num.EXP_DIGITS if is_digit else _Num.EXP_SIGN if char in "+-" else None
        else:  # EXP_SIGN or EXP_DIGITS
            nxt = _Num.EXP_DIGITS if is_digit else None
        if nxt is not None:
            self._num = nxt
            return ScanStatus.MORE
        if num not in _NUMBER_MAY_END:
            return self._fail()
        # The number ended just before this character, which belongs to what follows it.
        if self._value_ended() is ScanStatus.DONE:
            return ScanStatus.ENDED
        return self.push(char)

    def _close(self) -> ScanStatus:
        self._stack.pop()
        return self._value_ended()

    def _value_ended(self) -> ScanStatus:
        if self._stack:
            self._mode = _Mode.AFTER_VALUE
            return ScanStatus.MORE
        self._mode = _Mode.DONE
        return ScanStatus.DONE

    def _fail(self) -> ScanStatus:
        self._mode = _Mode.FAILED
        return ScanStatus.ERROR


class ObjectEvent(enum.Enum):
    NOTHING = "nothing"  # accepted; structure or whitespace
    NAME = "name"  # accepted; it closed the name string (`ToolCallObjectScanner.name` is set)
    ARGUMENTS = "arguments"  # accepted; it is part of the arguments object's text
    DONE = "done"  # accepted; it closed the tool-call object
    ERROR = "error"  # rejected: the text cannot be a tool call


class _Obj(enum.Enum):
    OPEN = enum.auto()
    KEY_OR_CLOSE = enum.auto()
    KEY = enum.auto()
    IN_KEY = enum.auto()
    COLON = enum.auto()
    VALUE_START = enum.auto()
    IN_NAME = enum.auto()
    IN_ARGUMENTS = enum.auto()
    IN_IGNORED = enum.auto()
    AFTER_VALUE = enum.auto()
    DONE = enum.auto()
    FAILED = enum.auto()


class ToolCallObjectScanner:
    """Reads the JSON object a tool call is written as, one character at a time.

    The object must hold a non-empty string ``"name"`` and an object under one of
    `arguments_keys`, in either order; keys in `ignored_keys` may appear with any value. Any
    other key, a repeated key, a name that is not a string, arguments that are not an object, or
    invalid JSON is an ERROR at the first character that shows it.
    """

    def __init__(self, arguments_keys: frozenset[str], ignored_keys: frozenset[str] = frozenset()) -> None:
        self._arguments_keys = arguments_keys
        self._ignored_keys = ignored_keys
        self._state = _Obj.OPEN
        self._value = JsonScanner()
        self._raw = ""  # text of the key or name string being read, decoded when complete
        self._role = ""  # what the current member's value is: "name", "arguments" or "ignored"
        self._seen_arguments = False
        self.name: str | None = None

    @property
    def arguments_started(self) -> bool:
        return self._seen_arguments

    def push(self, char: str) -> ObjectEvent:
        state = self._state
        if state is _Obj.IN_ARGUMENTS:
            status = self._value.push(char)
            if status is ScanStatus.ERROR:
                return self._fail()
            if status is ScanStatus.DONE:
                self._state = _Obj.AFTER_VALUE
            return ObjectEvent.ARGUMENTS
        if state is _Obj.IN_KEY or state is _Obj.IN_NAME:
            self._raw += char
            status = self._value.push(char)
            if status is ScanStatus.ERROR:
                return self._fail()
            if status is ScanStatus.MORE:
                return ObjectEvent.NOTHING
            return self._key_read() if state is _Obj.IN_KEY else self._name_read()
        if state is _Obj.IN_IGNORED:
            status = self._value.push(char)
            if status is ScanStatus.ERROR:
                return self._fail()
            if status is ScanStatus.MORE:
                return ObjectEvent.NOTHING
            self._state = _Obj.AFTER_VALUE
            return self.push(char) if status is ScanStatus.ENDED else ObjectEvent.NOTHING
        if char in _WHITESPACE and state is not _Obj.DONE and state is not _Obj.FAILED:
            return ObjectEvent.NOTHING
        if state is _Obj.OPEN:
            if char != "{":
                return self._fail()
            self._state = _Obj.KEY_OR_CLOSE
            return ObjectEvent.NOTHING
        if state is _Obj.KEY_OR_CLOSE or state is _Obj.KEY:
            if char != '"':
                return self._fail()  # includes "{}": a call needs a name
            self._state, self._value, self._raw = _Obj.IN_KEY, JsonScanner(), char
            self._value.push(char)
            return ObjectEvent.NOTHING
        if state is _Obj.COLON:
            if char != ":":
                return self._fail()
            self._state = _Obj.VALUE_START
            return ObjectEvent.NOTHING
        if state is _Obj.VALUE_START:
            return self._value_start(char)
        if state is _Obj.AFTER_VALUE:
            if char == ",":
                self._state = _Obj.KEY
                return ObjectEvent.NOTHING
            if char == "}" and self.name is not None and self._seen_arguments:
                self._state = _Obj.DONE
                return ObjectEvent.DONE
        return self._fail()

    def _key_read(self) -> ObjectEvent:
        key = json.loads(self._raw)
        if key == "name" and self.name is None:
            self._role = "name"
        elif key in self._arguments_keys and not self._seen_arguments:
            self._role = "arguments"
        elif key in self._ignored_keys:
            self._role = "ignored"
        else:
            return self._fail()
        self._state = _Obj.COLON
        return ObjectEvent.NOTHING

    def _name_read(self) -> ObjectEvent:
        name = json.loads(self._raw)
        if not name:
            return self._fail()
        self.name = name
        self._state = _Obj.AFTER_VALUE
        return ObjectEvent.NAME

    def _value_start(self, char: str) -> ObjectEvent:
        self._value = JsonScanner()
        if self._role == "name":
            if char != '"':
                return self._fail()
            self._state, self._raw = _Obj.IN_NAME, char
            self._value.push(char)
            return ObjectEvent.NOTHING
        if self._role == "arguments":
            if char != "{":
                return self._fail()
            self._state, self._seen_arguments = _Obj.IN_ARGUMENTS, True
            self._value.push(char)
            return ObjectEvent.ARGUMENTS
        self._state = _Obj.IN_IGNORED
        if self._value.push(char) is ScanStatus.ERROR:
            return self._fail()
        return ObjectEvent.NOTHING

    def _fail(self) -> ObjectEvent:
        self._state = _Obj.FAILED
        return ObjectEvent.ERROR
