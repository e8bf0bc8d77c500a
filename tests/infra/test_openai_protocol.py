"""The OpenAI request models: what is accepted, what is refused (each field named), and the
SamplingParams and ChatPrompt a valid request becomes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from infra.gateway_backend import InvalidRequest
from infra.openai_errors import error_from_validation, param_from_loc
from infra.openai_protocol import IGNORED_FIELDS, COMPLETION_DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from wire import ChatPrompt, GrammarSpec
from worker import SamplingParams

CHAT = [{"role": "user", "content": "hi"}]


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "acme/m", "prompt": "hello", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "acme/m", "messages": CHAT, **fields})


def refusal(model, body) -> tuple[str | None, str]:
    """(param, message) of the 400 the gateway would answer with."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    error = error_from_validation(info.value.errors())
    assert error.status_code == 400 and error.type == "invalid_request_error"
    return error.param, error.message


def test_defaults_map_to_openai_semantics():
    params = completion().to_sampling_params(COMPLETION_DEFAULT_MAX_TOKENS)
    # Left out: the model's generation_config.json may set them at the worker.
    assert params == SamplingParams(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0,
                                    model_defaults=("temperature", "top_k", "top_p"))
    assert completion().prompt_input() == "hello"
    assert not completion().include_usage


def test_every_supported_field_reaches_sampling_params():
    params = completion(
        max_tokens=7, temperature=0, top_p=0.5, top_k=3, seed=2**64 - 1, stop=["x", "yz"],
        stop_token_ids=[1, 2], ignore_eos=True, n=1, logprobs=None, presence_penalty=0, frequency_penalty=0.0,
        echo=False, best_of=1, user="u1", stream=True, stream_options={"include_usage": True},
    ).to_sampling_params(16)
    assert params == SamplingParams(max_tokens=7, temperature=0.0, top_p=0.5, top_k=3, seed=2**64 - 1,
                                    stop=("x", "yz"), stop_token_ids=(1, 2), ignore_eos=True)
    assert completion(stop="end").to_sampling_params(16).stop == ("end",)
    assert completion(top_k=-1).to_sampling_params(16).top_k == 0  # vLLM's "disabled"


def test_penalties_bias_and_vllm_extras_reach_sampling_params():
    fields = dict(presence_penalty=0.5, frequency_penalty=-1.5, repetition_penalty=1.3, min_p=0.05,
                  logit_bias={"7": 5.0, "3": -100}, min_tokens=2, max_tokens=9)
    for request in (completion(**fields), chat(**fields)):
        params = request.to_sampling_params(16)
        assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p,
                params.logit_bias, params.min_tokens) == (0.5, -1.5, 1.3, 0.05, ((3, -100.0), (7, 5.0)), 2)
        assert params.skip_special_tokens is True
    assert completion(skip_special_tokens=False).to_sampling_params(16).skip_special_tokens is False


def test_logprobs_in_each_endpoints_form():
    assert completion().to_sampling_params(16).logprobs is None
    # The legacy completions form: 0 still asks for each token's own log-probability.
    assert completion(logprobs=0).to_sampling_params(16).logprobs == 0
    assert completion(logprobs=5).to_sampling_params(16).logprobs == 5
    assert chat(logprobs=False, top_logprobs=0).to_sampling_params(16).logprobs is None
    assert chat(logprobs=True).to_sampling_params(16).logprobs == 0
    assert chat(logprobs=True, top_logprobs=20).to_sampling_params(16).logprobs == 20


def test_a_logit_bias_with_too_many_tokens_is_a_400_naming_logit_bias():
    with pytest.raises(InvalidRequest) as info:
        completion(logit_bias={str(i): 1.0 for i in range(5000)}).to_sampling_params(16)
    assert info.value.param == "logit_bias" and "at most" in info.value.message


def test_nulls_mean_defaults():
    body = {name: None for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream")}
    assert completion(**body).to_sampling_params(16) == SamplingParams(
        max_tokens=16, model_defaults=("temperature", "top_k", "top_p"))
    assert completion(temperature=0.5).to_sampling_params(16).model_defaults == ("top_k", "top_p")


def test_chat_max_completion_tokens_wins_and_default_comes_from_the_caller():
    assert chat().to_sampling_params(200).max_tokens == 200
    assert chat(max_tokens=5).to_sampling_params(200).max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).to_sampling_params(200).max_tokens == 9


def test_chat_messages_become_template_input():
    request = chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"},
        {"role": "assistant", "content": "ok"},
    ])
    assert request.chat_prompt() == ChatPrompt(messages=(
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab", "name": "x"},
        {"role": "assistant", "content": "ok"},
    ))


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_calls_and_template_kwargs_reach_the_chat_prompt():
    request = chat(messages=[
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ], tools=[WEATHER_TOOL], tool_choice="auto", chat_template_kwargs={"enable_thinking": False})
    prompt = request.chat_prompt()
    assert prompt.messages == (
        {"role": "user", "content": "weather in Oslo?"},
        # Arguments that are a JSON object reach the template as the object (vLLM's rule), others as text.
        {"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "content": "-3 C", "tool_call_id": "call_1"},
    )
    assert prompt.tools == (WEATHER_TOOL,)
    assert prompt.template_kwargs == {"enable_thinking": False}


def test_harmless_fields_are_accepted_and_change_nothing():
    plain = chat().to_sampling_params(8)
    harmless = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                "prompt_cache_key": "abc", "safety_identifier": "s", "parallel_tool_calls": True}
    assert set(harmless) == set(IGNORED_FIELDS)
    request = chat(**harmless)
    assert request.to_sampling_params(8) == plain and request.chat_prompt() == chat().chat_prompt()
    assert completion(**{k: v for k, v in harmless.items() if k != "parallel_tool_calls"}).to_sampling_params(8) \
        == completion().to_sampling_params(8)


def test_continuous_usage_is_read_from_stream_options():
    assert chat(stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage
    assert not chat(stream=True, stream_options={"include_usage": True}).continuous_usage


@pytest.mark.parametrize("prompt, expected", [
    ("text", "text"), ([5, 6, 7], [5, 6, 7]), (["only one"], "only one"), ([[1, 2]], [1, 2]),
])
def test_one_prompt_in_any_form(prompt, expected):
    assert completion(prompt=prompt).prompt_input() == expected


@pytest.mark.parametrize("field, value, param, words", [
    ("temperature", -0.5, "temperature", "greater than or equal to 0"),
    ("temperature", "0.5", "temperature", "valid number"),
    ("top_p", 0, "top_p", "greater than 0"),
    ("top_p", 1.5, "top_p", "less than or equal to 1"),
    ("top_k", -2, "top_k", "greater than or equal to -1"),
    ("max_tokens", 0, "max_tokens", "greater than or equal to 1"),
    ("max_tokens", True, "max_tokens", "valid integer"),
    ("max_tokens", 2.5, "max_tokens", "valid integer"),
    ("seed", -1, "seed", "greater than or equal to 0"),
    ("seed", 2**64, "seed", "less than"),
    ("stop", ["ok", ""], "stop", "non-empty"),
    ("stop", 3, "stop", "one of these forms"),
    ("stop_token_ids", [1, -1], "stop_token_ids", ">= 0"),
    ("ignore_eos", "yes", "ignore_eos", "valid boolean"),
    ("stream", 1, "stream", "valid boolean"),
    ("n", 17, "n", "less than or equal to 16"),
    ("n", 0, "n", "greater than or equal to 1"),
    ("logprobs", 21, "logprobs", "less than or equal to 20"),
    ("logprobs", True, "logprobs", "valid integer"),
    ("presence_penalty", 2.5, "presence_penalty", "less than or equal to 2"),
    ("frequency_penalty", -3, "frequency_penalty", "greater than or equal to -2"),
    ("repetition_penalty", 0, "repetition_penalty", "greater than 0"),
    ("min_p", 1.5, "min_p", "less than or equal to 1"),
    ("min_tokens", -1, "min_tokens", "greater than or equal to 0"),
    ("logit_bias", {"5": "x"}, "logit_bias", "the bias of token 5 must be a number in [-100, 100]"),
    ("logit_bias", {"5": float("nan")}, "logit_bias", "the bias of token 5 must be"),
    ("logit_bias", {"5": 101}, "logit_bias", "the bias of token 5 must be"),
    ("logit_bias", {"a b": 1}, "logit_bias", "keys must be token ids"),
    ("echo", 1, "echo", "valid boolean"),
    ("best_of", 3, "best_of", "not supported"),
    ("tempreature", 0.5, "tempreature", "not a known field"),
    ("prompt", "", "prompt", "must not be empty"),
    ("prompt", [], "prompt", "must not be empty"),
    ("prompt", ["a", "b"], "prompt", "batched prompts are not supported"),
    ("prompt", [1, -3], "prompt", ">= 0"),
    ("prompt", [1, "a"], "prompt[1]", "valid integer"),
    ("prompt", 7, "prompt", "one of these forms"),
    ("prompt", "ok \ud800", "prompt", "lone surrogate"),  # JSON can escape one; no tokenizer encodes it
    ("stop", ["\udfff"], "stop", "lone surrogate"),
    ("stream_options", {"include_usage": True}, "stream_options", "only allowed with stream"),
])
def test_a_bad_field_is_named(field, value, param, words):
    got_param, message = refusal(CompletionRequest, {"model": "acme/m", "prompt": "x", field: value})
    assert got_param == param
    assert words in message and f"{param}:" in message


def test_nan_is_refused():
    # Python's JSON reader turns the literal NaN into a float; it is not a temperature.
    assert refusal(CompletionRequest, {"prompt": "x", "temperature": float("nan")})[0] == "temperature"


def test_every_bad_field_is_listed_and_the_first_is_param():
    param, message = refusal(CompletionRequest, {"prompt": "x", "temperature": -1, "top_p": 7, "bogus": 1})
    assert param == "temperature"
    assert message == ("invalid request: temperature: Input should be greater than or equal to 0; "
                       "top_p: Input should be less than or equal to 1; bogus: is not a known field")


@pytest.mark.parametrize("body, param, words", [
    ({"messages": []}, "messages", "at least 1"),
    ({}, "messages", "is required"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "'system'"),
    ({"messages": [{"role": "user"}]}, "messages[0]", "content is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[0].type", "'text'"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content", "lone surrogate"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[0].text", "lone surrogate"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function", "is required"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
     "should match pattern"),
    ({"messages": CHAT, "tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({"messages": CHAT, "logprobs": 1}, "logprobs", "valid boolean"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"messages": CHAT, "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "not among the tools (get_weather)"),
    ({"messages": CHAT, "tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice", "'none'"),
    ({"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set messages"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0]", "content is required"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0]", "only allowed on assistant messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0]", "only allowed on tool"),
    ({"messages": CHAT, "metadata": {"k": 1}}, "metadata.k", "valid string"),
    ({"messages": CHAT, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats", "valid boolean"),
    ({"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format",
     'json_schema must be given exactly when type is "json_schema"'),
    ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name", "should match pattern"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
    ({"messages": CHAT, "guided_json": "{not json"}, "guided_json", "the JSON schema is not valid JSON"),
    ({"messages": CHAT, "guided_choice": []}, "guided_choice", "non-empty list of strings"),
    ({"messages": CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "give one constraint, not 2 (regex, choice)"),
    ({"messages": CHAT, "structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar",
     "not a known field"),])
def test_chat_refusals_name_the_field(body, param, words):
    got_param, message = refusal(ChatCompletionRequest, body)
    assert got_param == param and words in message


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_object"}}, GrammarSpec.json_object()),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}},
     GrammarSpec.json_schema(SCHEMA)),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, GrammarSpec.json_schema(SCHEMA)),
    ({"guided_json": '{"type": "object"}'}, GrammarSpec.json_schema({"type": "object"})),
    ({"guided_regex": "[0-9]+"}, GrammarSpec.regex("[0-9]+")),
    ({"guided_choice": ["yes", "no"]}, GrammarSpec.choice(["yes", "no"])),
    ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"choice": ["x"]}}, GrammarSpec.choice(["x"])),
    ({"structured_outputs": {"json_object": True}}, GrammarSpec.json_object()),
    ({}, None),
])
def test_structured_output_in_each_form_becomes_one_grammar(fields, expected):
    assert chat(**fields).to_sampling_params(8).structured_output == expected
    assert completion(**fields).to_sampling_params(8).structured_output == expected


def test_echo_needs_a_text_prompt_and_no_logprobs():
    assert completion(echo=True).echo
    assert refusal(CompletionRequest, {"prompt": [1, 2], "echo": True}) == (
        "echo", "invalid request: echo: is supported for a text prompt only, not for token ids")
    param, message = refusal(CompletionRequest, {"prompt": "x", "logprobs": 1, "echo": True})
    assert param == "echo" and "prompt's log-probabilities" in message


def test_two_structured_output_fields_are_a_400_naming_the_second():
    with pytest.raises(InvalidRequest) as info:
        chat(response_format={"type": "json_object"}, guided_regex="a+").to_sampling_params(8)
    assert info.value.param == "guided_regex" and "send one of them" in info.value.message


def test_tool_choice_required_or_named_forces_calls():
    assert chat(tools=[WEATHER_TOOL], tool_choice="required").forces_tool_calls
    named = chat(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.forces_tool_calls and named.forced_function == "get_weather"
    assert not chat(tools=[WEATHER_TOOL], tool_choice="auto").forces_tool_calls


def test_neutral_values_of_unserved_fields_are_accepted():
    request = chat(tools=[], tool_choice="none", response_format={"type": "text"}, logprobs=False, top_logprobs=0)
    assert request.chat_prompt().tools == ()
    assert request.to_sampling_params(4).max_tokens == 4


def test_sampling_params_refusal_becomes_invalid_request_naming_the_field():
    # Every bound is checked by pydantic first; this is the guard behind it.
    request = completion(temperature=0.5)
    object.__setattr__(request, "temperature", -1.0)
    with pytest.raises(InvalidRequest) as info:
        request.to_sampling_params(16)
    assert info.value.param == "temperature" and "temperature must be" in info.value.message


@pytest.mark.parametrize("loc, param", [
    (("body", "temperature"), "temperature"),
    (("body", "messages", 0, "content", "list[TextContentPart]", 1, "type"), "messages[0].content[1].type"),
    (("body", "prompt", "list[int]", 2), "prompt[2]"),
    (("body",), None),
])
def test_param_from_loc(loc, param):
    assert param_from_loc(loc) == param


def test_too_many_or_too_long_stop_sequences_are_a_400_naming_stop():
    with pytest.raises(InvalidRequest) as info:
        completion(stop=[f"s{i}" for i in range(17)]).to_sampling_params(16)
    assert info.value.param == "stop" and "at most 16 sequences" in info.value.message
    with pytest.raises(InvalidRequest) as info:
        chat(stop="x" * 300).to_sampling_params(16)
    assert info.value.param == "stop" and "at most 256 characters, got 300" in info.value.message
