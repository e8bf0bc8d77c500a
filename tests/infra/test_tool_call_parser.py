"""Tool calls read out of generated text: each format's calls, content and failures, ids from the
injected random source, the format read from a chat template, and the streaming promises (held
back until decided, arguments as they arrive, the same result for any split of the text)."""

from __future__ import annotations

import json
import random

import pytest

from infra.tool_call_parser import (
    TOOL_CALL_FORMATS,
    ContentDelta,
    ParsedOutput,
    ParsedToolCall,
    ToolCallDelta,
    ToolCallStreamParser,
    detect_tool_call_format,
    merge_deltas,
    parse_tool_calls,
    tool_calls_finish_reason,
)

SEED = 1234


def openai_ids(count: int, seed: int = SEED) -> list[str]:
    rng = random.Random(seed)
    return [f"call_{rng.getrandbits(96):024x}" for _ in range(count)]


def mistral_ids(count: int, seed: int = SEED) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return ["".join(rng.choice(alphabet) for _ in range(9)) for _ in range(count)]


def ids(fmt: str, count: int) -> list[str]:
    return mistral_ids(count) if fmt == "mistral" else openai_ids(count)


def parse(fmt: str, text: str) -> ParsedOutput:
    return parse_tool_calls(text, fmt, random.Random(SEED))


def stream(fmt: str, pieces: list[str]) -> list[list[ContentDelta | ToolCallDelta]]:
    """The deltas each feed returned, then finish's."""
    parser = ToolCallStreamParser(fmt, random.Random(SEED))
    return [parser.feed(piece) for piece in pieces] + [parser.finish()]


def streamed(fmt: str, pieces: list[str]) -> ParsedOutput:
    return merge_deltas([d for batch in stream(fmt, pieces) for d in batch])


def calls(fmt: str, *pairs: tuple[str, str]) -> tuple[ParsedToolCall, ...]:
    return tuple(ParsedToolCall(i, name, args) for i, (name, args) in zip(ids(fmt, len(pairs)), pairs))


def hermes_call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


# ---------------------------------------------------------------------------------- hermes

def test_hermes_plain_text_is_content_unchanged():
    text = "The weather in <b>Paris</b> is mild; use <tool> tags? No."
    assert parse("hermes", text) == ParsedOutput(content=text, tool_calls=())


def test_hermes_one_call():
    text = hermes_call("get_weather", '{"city": "Paris", "unit": "celsius"}')
    assert parse("hermes", text) == ParsedOutput(
        None, calls("hermes", ("get_weather", '{"city": "Paris", "unit": "celsius"}')))


def test_hermes_two_calls_whitespace_between_them_dropped():
    text = hermes_call("a", '{"x": 1}') + "\n" + hermes_call("b", "{}") + "\n"
    assert parse("hermes", text) == ParsedOutput(None, calls("hermes", ("a", '{"x": 1}'), ("b", "{}")))


def test_hermes_text_and_think_before_a_call_are_content():
    text = "<think>\nThe user wants weather.\n</think>\n\nLet me check." + hermes_call("w", '{"c": "Oslo"}')
    assert parse("hermes", text) == ParsedOutput(
        "<think>\nThe user wants weather.\n</think>\n\nLet me check.", calls("hermes", ("w", '{"c": "Oslo"}')))


def test_hermes_arguments_before_name_and_unclosed_last_call():
    text = '<tool_call>{"arguments": {"q": "a}b"}, "name": "search"}'
    assert parse("hermes", text) == ParsedOutput(None, calls("hermes", ("search", '{"q": "a}b"}')))


def test_hermes_new_call_without_closing_the_previous_one():
    text = '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert parse("hermes", text) == ParsedOutput(None, calls("hermes", ("a", "{}"), ("b", "{}")))


@pytest.mark.parametrize("body", [
    '{"name": get_weather, "arguments": {}}',  # not JSON
    "{'name': 'f', 'arguments': {}}",  # Python, not JSON
    '{"function": "f", "arguments": {}}',  # a key other than name and arguments
    '{"name": "", "arguments": {}}',  # an empty name
    '{"name": "f", "arguments": "{}"}',  # arguments not an object
    '{"name": "f"}',  # no arguments
    '{"name": "f", "name": "g", "arguments": {}}',  # the name twice
    "I think I should call a tool",
])
def test_hermes_invalid_json_inside_the_marker_stays_content(body):
    text = f"Hi.\n<tool_call>\n{body}\n</tool_call>"
    assert parse("hermes", text) == ParsedOutput(text, ())


def test_hermes_text_after_an_invalid_call_is_still_read_for_calls():
    text = "<tool_call>oops</tool_call>" + hermes_call("f", "{}")
    assert parse("hermes", text) == ParsedOutput("<tool_call>oops</tool_call>", calls("hermes", ("f", "{}")))


def test_hermes_json_broken_after_the_call_was_decided_keeps_what_was_sent():
    # The name and the start of the arguments were streamed already: they cannot be taken back.
    text = '<tool_call>{"name": "f", "arguments": {"x": 1]}}</tool_call>'
    assert parse("hermes", text) == ParsedOutput("]}}</tool_call>", calls("hermes", ("f", '{"x": 1')))


def test_hermes_output_cut_inside_the_arguments_keeps_them_truncated():
    text = 'Ok <tool_call>\n{"name": "f", "arguments": {"city": "Par'
    assert parse("hermes", text) == ParsedOutput("Ok ", calls("hermes", ("f", '{"city": "Par')))


@pytest.mark.parametrize("text", ["<tool_", "<tool_call>", '<tool_call>\n{"name": "f", ', "\n\n"])
def test_hermes_held_text_without_a_call_is_content_at_the_end(text):
    assert parse("hermes", text) == ParsedOutput(text, ())


def test_hermes_text_after_calls_is_content():
    text = hermes_call("f", "{}") + "\n\nDone."
    assert parse("hermes", text) == ParsedOutput("\n\nDone.", calls("hermes", ("f", "{}")))


# ---------------------------------------------------------------------------------- llama3_json

def test_llama3_plain_text_and_plain_json_are_content():
    for text in ["Paris is in France.", '{"answer": 42}', "[1, 2]", "  {not json", "<|python_tag|>x.call()"]:
        assert parse("llama3_json", text) == ParsedOutput(text, ())


def test_llama3_one_call_with_parameters():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse("llama3_json", text) == ParsedOutput(None, calls("llama3_json", ("get_weather", '{"city": "Paris"}')))


def test_llama3_two_calls_after_python_tag():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": [1, 2]}}; {"name": "b", "arguments": {}}'
    assert parse("llama3_json", text) == ParsedOutput(
        None, calls("llama3_json", ("a", '{"x": [1, 2]}'), ("b", "{}")))


def test_llama3_text_before_a_call_means_no_call():
    # Llama's format is the whole output; JSON after prose is the model talking about JSON.
    text = 'Here you go: {"name": "a", "parameters": {}}'
    assert parse("llama3_json", text) == ParsedOutput(text, ())


@pytest.mark.parametrize("text", ['{"name": a, "parameters": {}}', '{"name": "a", "params": {}}',
                                  '{"parameters": {"x": 1}, "name": 7}'])
def test_llama3_invalid_json_stays_content(text):
    assert parse("llama3_json", text) == ParsedOutput(text, ())


def test_llama3_output_cut_after_the_arguments_is_still_the_call():
    text = '{"name": "a", "parameters": {"x": 1}'
    assert parse("llama3_json", text) == ParsedOutput(None, calls("llama3_json", ("a", '{"x": 1}')))


def test_llama3_text_after_a_call_is_content():
    text = '{"name": "a", "parameters": {}}\nThat is the call.'
    assert parse("llama3_json", text) == ParsedOutput("\nThat is the call.", calls("llama3_json", ("a", "{}")))


# ---------------------------------------------------------------------------------- mistral

def test_mistral_plain_text_is_content():
    text = "Sure, [1, 2] is a list and [TOOL is not a marker."
    assert parse("mistral", text) == ParsedOutput(text, ())


def test_mistral_one_call_array_form():
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert parse("mistral", text) == ParsedOutput(None, calls("mistral", ("get_weather", '{"city": "Paris"}')))


def test_mistral_two_calls_array_form_with_ids_ignored():
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}, "id": "abcDEF123"}, {"name": "b", "arguments": {"y": null}}]'
    assert parse("mistral", text) == ParsedOutput(None, calls("mistral", ("a", "{}"), ("b", '{"y": null}')))


def test_mistral_text_before_calls_and_new_form():
    text = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
    assert parse("mistral", text) == ParsedOutput(
        "Checking.", calls("mistral", ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")))


@pytest.mark.parametrize("body", ['[{"name": f}]', "[]", " sorry", "get weather[ARGS]{}", "f[ARGZ]{}",
                                  "f[ARGS] {}", '[{"name": "f", "arguments": []}]'])
def test_mistral_invalid_calls_stay_content(body):
    text = "[TOOL_CALLS]" + body
    assert parse("mistral", text) == ParsedOutput(text, ())


def test_mistral_ids_are_nine_alphanumerics():
    (call,) = parse("mistral", '[TOOL_CALLS]f[ARGS]{}').tool_calls
    assert call.id == mistral_ids(1)[0]
    assert len(call.id) == 9 and call.id.isalnum()


# ---------------------------------------------------------------------------------- shared

VALID = {
    "hermes": ("Let me look. ", hermes_call("get_weather", '{"city": "Paris"}')),
    "llama3_json": ("", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    "mistral": ("Let me look. ", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
}


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS)
def test_ids_come_from_the_injected_random_source(fmt):
    prefix, call = VALID[fmt]
    (first,) = parse_tool_calls(prefix + call, fmt, random.Random(1)).tool_calls
    (again,) = parse_tool_calls(prefix + call, fmt, random.Random(1)).tool_calls
    (other,) = parse_tool_calls(prefix + call, fmt, random.Random(2)).tool_calls
    assert first.id == again.id != other.id
    if fmt != "mistral":
        assert first.id == openai_ids(1, seed=1)[0]
        assert first.id.startswith("call_") and len(first.id) == 29


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS)
def test_marker_split_at_every_position(fmt):
    prefix, call = VALID[fmt]
    text = prefix + call
    whole = parse(fmt, text)
    assert whole == ParsedOutput(prefix or None, calls(fmt, ("get_weather", '{"city": "Paris"}')))
    for cut in range(1, len(text)):
        first, second, end = stream(fmt, [text[:cut], text[cut:]])
        sent_content = "".join(d.text for d in first if isinstance(d, ContentDelta))
        # Never content that turns out to be part of the call: the prefix, as far as it came.
        assert sent_content == prefix[:cut]
        assert merge_deltas(first + second + end) == whole


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS)
def test_arguments_stream_as_they_arrive(fmt):
    prefix, call = VALID[fmt]
    text = prefix + call
    cut = text.index('"Par') + 4  # inside the arguments' string value
    first, rest, end = stream(fmt, [text[:cut], text[cut:]])
    assert first[-1] == ToolCallDelta(0, ids(fmt, 1)[0], "get_weather", '{"city": "Par')
    assert [d for d in rest if isinstance(d, ToolCallDelta)] == [ToolCallDelta(0, None, None, 'is"}')]
    assert end == []


def test_each_delta_batch_is_joined_by_kind():
    text = "Hi " + hermes_call("a", '{"x": 1}') + hermes_call("b", "{}")
    (batch, end) = stream("hermes", [text])
    a, b = openai_ids(2)
    assert batch == [ContentDelta("Hi "), ToolCallDelta(0, a, "a", '{"x": 1}'), ToolCallDelta(1, b, "b", "{}")]
    assert end == []


def test_finish_reason_rule():
    assert tool_calls_finish_reason("stop", 2) == "tool_calls"
    assert tool_calls_finish_reason("stop", 0) == "stop"
    assert tool_calls_finish_reason("length", 1) == "length"


def test_misuse_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="use one of hermes, llama3_json, mistral"):
        ToolCallStreamParser("qwen", random.Random(0))
    parser = ToolCallStreamParser("hermes", random.Random(0))
    parser.finish()
    with pytest.raises(ValueError, match="start a new ToolCallStreamParser"):
        parser.feed("x")


# ------------------------------------------------------------------ random splits, random outputs

def random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -7, 3.25, 1e-9, 123456789012])
    if kind in (2, 3):
        return rng.choice(["", "a}b", 'q"uote', "back\\slash", "é☃\n", "<tool_call>", "[ARGS]", ";"])
    if kind in (4, 5):
        return {rng.choice(["k", "name", "arguments", "ü", "a b"]) + str(i): random_json(rng, depth + 1)
                for i in range(rng.randrange(4))}
    return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]


def random_arguments(rng: random.Random) -> str:
    args = {f"p{i}": random_json(rng, 1) for i in range(rng.randrange(4))}
    return json.dumps(args, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, None, 2]))


def well_formed(fmt: str, rng: random.Random) -> tuple[str, ParsedOutput]:
    """A random output the model could write with its calls, and what it must parse into."""
    pairs = [(rng.choice(["get_weather", "f", "search.web", "x-1"]), random_arguments(rng))
             for _ in range(rng.randrange(4))]
    content = rng.choice(["", "Sure. ", "<think>\nhmm [x] <b>\n</think>\n\n", "a < b and [c]"])
    if fmt == "hermes":
        text = content + "\n".join(hermes_call(n, a) for n, a in pairs)
    elif fmt == "llama3_json":
        content = "" if pairs else content
        key = rng.choice(["parameters", "arguments"])
        text = rng.choice(["", "<|python_tag|>"]) if pairs else content
        text += "; ".join(f'{{"name": "{n}", "{key}": {a}}}' for n, a in pairs)
    elif rng.random() < 0.5:
        items = ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in pairs)
        text = content + (f"[TOOL_CALLS][{items}]" if pairs else "")
    else:
        text = content + "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in pairs)
    return text, ParsedOutput(content or None, calls(fmt, *pairs))


FRAGMENTS = ["Hi ", "\n", "  ", "<", "<tool_", "<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]",
             "[", "]", "[ARGS]", "{", "}", '"', ",", ";", ":", '{"name": "f", ', '"arguments": ', '"parameters": ',
             '{"a": 1}', '{"name": "g", "arguments": {"b": [true]}}', "f", '\\"', "<think>", "</think>"]


def random_output(fmt: str, rng: random.Random) -> str:
    if rng.random() < 0.5:
        return well_formed(fmt, rng)[0]
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randrange(1, 12)))


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS)
def test_well_formed_outputs_parse_to_their_calls(fmt):
    rng = random.Random(fmt)
    for _ in range(300):
        text, want = well_formed(fmt, rng)
        assert parse(fmt, text) == want, text


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS)
def test_any_split_streams_what_the_whole_text_parses_to(fmt):
    rng = random.Random(f"split-{fmt}")
    for _ in range(400):
        text = random_output(fmt, rng)
        whole = parse(fmt, text)
        for pieces in [list(text), *(random_split(text, rng) for _ in range(4))]:
            batches = stream(fmt, pieces)
            sent: list[ContentDelta | ToolCallDelta] = []
            for batch in batches:
                sent += batch
                # What was sent is never taken back: a prefix of the final content and arguments.
                so_far = merge_deltas(sent)
                assert (whole.content or "").startswith(so_far.content or ""), (text, pieces)
                for got, final in zip(so_far.tool_calls, whole.tool_calls, strict=False):
                    assert (got.id, got.name) == (final.id, final.name)
                    assert final.arguments_json.startswith(got.arguments_json)
            assert merge_deltas(sent) == whole, (text, pieces)
            assert all(not (isinstance(d, ContentDelta) and d.text == "") for d in sent)


# ---------------------------------------------------------------------------------- detection

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, "
        "\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "assistant" and message.tool_calls %}
        {%- for tool_call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.function.name }}{{- '", "arguments": ' }}
            {{- tool_call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
    {%- endif %}
{%- endfor %}"""

LLAMA31_TEMPLATE = """{%- if tools_in_user_message and not tools is none %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- "<|python_tag|>" + tool_call.name + ".call(" }}
    {%- else %}
        {{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}
    {%- endif %}
{%- endfor %}"""

LLAMA32_TEMPLATE = LLAMA31_TEMPLATE.replace('{{- "<|python_tag|>" + tool_call.name + ".call(" }}', "")

MISTRAL_TEMPLATE = """{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}{%- for tool in tools %}{{- tool|tojson }}{%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endfor %}"""

LLAMA3_NO_TOOLS_TEMPLATE = """{% for message in messages %}{{ '<|start_header_id|>' + message['role'] +
'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"""

CHATML_NO_TOOLS_TEMPLATE = """{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' +
message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"""

QWEN3_CODER_TEMPLATE = """{{- "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\n"
"value_1\\n</parameter>\\n</function>\\n</tool_call>" }}"""


@pytest.mark.parametrize("template, want", [
    (QWEN25_TEMPLATE, "hermes"),
    (LLAMA31_TEMPLATE, "llama3_json"),
    (LLAMA32_TEMPLATE, "llama3_json"),
    (MISTRAL_TEMPLATE, "mistral"),
    (LLAMA3_NO_TOOLS_TEMPLATE, None),
    (CHATML_NO_TOOLS_TEMPLATE, None),
    (QWEN3_CODER_TEMPLATE, None),  # XML calls, not parsed here
    ("", None),
])
def test_detect_tool_call_format(template, want):
    assert detect_tool_call_format(template) == want
