"""The OpenAI request models: what is accepted, what is refused (each field named), and the
SamplingParams a valid request becomes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from infra.gateway_backend import GenerationChunk, InvalidRequest
from infra.openai_errors import error_from_validation, param_from_loc
from infra.openai_protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    ChatRenderer,
    CompletionRenderer,
    CompletionRequest,
    Usage,
)
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
    assert request.prompt_messages() == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ok"},
    ]


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
    ("n", 2, "n", "not supported"),
    ("logprobs", 5, "logprobs", "not supported"),
    ("presence_penalty", 0.5, "presence_penalty", "not supported"),
    ("echo", True, "echo", "not supported"),
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
    ({"messages": [{"role": "user"}]}, "messages[0].content", "is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[0].type", "'text'"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content", "lone surrogate"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[0].text", "lone surrogate"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"messages": CHAT, "response_format": {"type": "json_object"}}, "response_format", "not supported"),
])
def test_chat_refusals_name_the_field(body, param, words):
    got_param, message = refusal(ChatCompletionRequest, body)
    assert got_param == param and words in message


def test_neutral_values_of_unserved_fields_are_accepted():
    request = chat(tools=[], tool_choice="none", response_format={"type": "text"}, logprobs=False, top_logprobs=0)
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


def chunk(text: str, finished: bool = False, **counts) -> GenerationChunk:
    return GenerationChunk(request_id="r", text=text, token_ids=(1,), finish_reason="length" if finished else None,
                           num_prompt_tokens=counts.get("p", 3), num_completion_tokens=counts.get("o", 1))


def test_chat_renderer_streams_role_then_content_then_finish():
    renderer = ChatRenderer(request_id="chatcmpl-1", model="acme/m", created=5)
    first = [o.model_dump(mode="json") for o in renderer.stream_objects(chunk("He"), is_first=True)]
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}, {"content": "He"}]
    assert first[0]["object"] == "chat.completion.chunk" and first[0]["usage"] is None
    assert renderer.stream_objects(chunk(""), is_first=False) == []  # half a UTF-8 character: nothing yet
    (last,) = [o.model_dump(mode="json") for o in renderer.stream_objects(chunk("", finished=True), False)]
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    usage = renderer.usage_object(Usage.of(3, 2)).model_dump(mode="json")
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                                         "total_tokens": 5}


def test_completion_renderer_whole_response():
    renderer = CompletionRenderer(request_id="cmpl-1", model="acme/m", created=5)
    body = renderer.whole("abc", "stop", Usage.of(4, 3)).model_dump(mode="json")
    assert body == {
        "id": "cmpl-1", "object": "text_completion", "created": 5, "model": "acme/m",
        "choices": [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
    }


def test_too_many_or_too_long_stop_sequences_are_a_400_naming_stop():
    with pytest.raises(InvalidRequest) as info:
        completion(stop=[f"s{i}" for i in range(17)]).to_sampling_params(16)
    assert info.value.param == "stop" and "at most 16 sequences" in info.value.message
    with pytest.raises(InvalidRequest) as info:
        chat(stop="x" * 300).to_sampling_params(16)
    assert info.value.param == "stop" and "at most 256 characters, got 300" in info.value.message
