"""Tool calls a request forces (``tool_choice`` "required" or a named function), as vLLM does them.

A forced call does not go through the model's own tool-call format: the output is constrained
by the grammar engine to compact JSON (`forced_tool_grammar`) -- for a named function its
arguments object, for "required" an array of ``{"name": ..., "parameters": {...}}`` with at
least one element, each name one of the tools and each ``parameters`` valid against that tool's
schema -- and `ForcedToolCalls` reads that JSON back into calls. So forcing works for every model,
whatever format (if any) its chat template teaches, and the calls always parse (the grammar saw
to it; an output cut short by ``max_tokens`` is the exception: it yields what parsed, with
``finish_reason`` "length").

`ForcedToolCalls` has the streaming parser's interface (`infra.tool_call_parser`): it holds the
text back and emits each call whole when the output ends, since a call is only known once its
JSON is complete.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from infra.tool_call_parser import ContentDelta, StreamDelta, ToolCallDelta
from wire import GrammarSpec

__all__ = ["MAX_FORCED_CALLS", "ForcedToolCalls", "forced_tool_grammar"]

_ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Most calls one forced reply may make: the array must end, even when the model would go on.
MAX_FORCED_CALLS = 8
# The calls' JSON is read by the gateway, never shown as text: no whitespace between its tokens, so
# no token goes to layout (the grammar engine's option, set in the schema).
_COMPACT: dict[str, Any] = {"x-guidance": {"whitespace_flexible": False}}


def _parameters(tool: Any) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


def forced_tool_grammar(tools: Sequence[Any], function_name: str | None, parallel: bool = True) -> GrammarSpec:
    """The constraint for ``tool_choice`` naming `function_name` (its arguments object), or, with
    None, for "required" (an array of 1 to `MAX_FORCED_CALLS` calls to any of `tools`, or exactly one
    without `parallel`: ``parallel_tool_calls: false``). `tools` are the request's tool
    definitions (``.function.name`` and ``.function.parameters``)."""
    if function_name is not None:
        (tool,) = [t for t in tools if t.function.name == function_name]
        return GrammarSpec.json_schema({**_parameters(tool), **_COMPACT})
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return GrammarSpec.json_schema({"type": "array", "minItems": 1, "maxItems": MAX_FORCED_CALLS if parallel else 1,
                                    "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, **_COMPACT})


class ForcedToolCalls:
    """Reads one forced output (see the module docstring) into tool-call deltas."""

    needs_special_tokens = False

    def __init__(self, function_name: str | None, rng: random.Random) -> None:
        self._function_name = function_name
        self._rng = rng
        self._text: list[str] = []
        self.num_tool_calls = 0

    def feed(self, text: str) -> list[StreamDelta]:
        self._text.append(text)
        return []

    def finish(self) -> list[StreamDelta]:
        text = "".join(self._text)
        try:
            value = json.loads(text)
        except ValueError:  # cut short by max_tokens: what the model wrote stays content
            return [ContentDelta(text)] if text else []
        if self._function_name is not None:
            calls = [(self._function_name, value)]
        else:
            calls = [(call["name"], call["parameters"]) for call in value]
        self.num_tool_calls = len(calls)
        return [ToolCallDelta(index=i, id=f"call_{self._rng.getrandbits(96):024x}", name=name,
                              arguments=json.dumps(arguments, ensure_ascii=False))
                for i, (name, arguments) in enumerate(calls)]
