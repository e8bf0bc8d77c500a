"""Which text format a model writes tool calls in: `TOOL_CALL_FORMATS`, `detect_tool_call_format`.

The name travels from the controller (which resolves a deploy's ``tool_call_parser: auto`` from the
model's chat template) to the gateway (whose `infra.tool_call_parser` reads calls out of the
generated text), in `ModelRecord.tool_call_format`; both sides take the names and the detection
from here. The names are vLLM's ``--tool-call-parser`` names for the same formats.
"""

from __future__ import annotations

__all__ = ["TOOL_CALL_FORMATS", "detect_tool_call_format"]

TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral")


def detect_tool_call_format(chat_template: str) -> str | None:
    """The format a model writes tool calls in, read from its chat template's source text;
    None when the template teaches no tool calls, or teaches a format not parsed here."""
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<tool_call>" in chat_template:
        # Qwen3-Coder's template wraps XML (<function=...><parameter=...>), not JSON.
        return None if "<function=" in chat_template else "hermes"
    if "<|python_tag|>" in chat_template or (
            "<|start_header_id|>" in chat_template and '"parameters"' in chat_template):
        return "llama3_json"
    return None
