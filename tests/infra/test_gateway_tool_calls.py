"""Tool calls through the gateway (real HTTP, the official `openai` client): a model's reply in its
tool-call format (Hermes' ``<tool_call>`` JSON here) reaches the client as OpenAI ``tool_calls``,
whole and streamed, with ``finish_reason`` "tool_calls"; the rest of the reply stays content.

The backend is scripted -- it "generates" the text the last user message asks for, in pieces of a
few characters -- because a random-weight model writes no tool calls; the parsing under test is
the gateway's, which is the same whatever generated the text.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai
import pytest

from infra.gateway_app import build_gateway_app
from infra.gateway_auth import GatewayAuth
from infra.gateway_backend import GenerationChunk, ModelCard, ModelNotFound, SamplingParams
from infra.threaded_server import served_app

KEY = "key-tools"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
REPLY = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n</tool_call>')


class ScriptedModel:
    """Replies with the last user message's text, three characters per chunk."""

    def __init__(self) -> None:
        self.cards = {"acme/qwen": ModelCard(model_id="acme/qwen", owned_by="acme", created_s=1,
                                             tool_call_format="hermes"),
                      "acme/mistral": ModelCard(model_id="acme/mistral", owned_by="acme", created_s=1,
                                                tool_call_format="mistral"),
                      "acme/plain": ModelCard(model_id="acme/plain", owned_by="acme", created_s=1)}
        self.params: list[SamplingParams] = []

    async def list_models(self, tenant: str | None) -> list[ModelCard]:
        return list(self.cards.values())

    async def describe_model(self, model_id: str) -> ModelCard:
        if model_id not in self.cards:
            raise ModelNotFound(model_id)
        return self.cards[model_id]

    async def generate(self, model_id: str, request_id: str, prompt, params: SamplingParams
                       ) -> AsyncIterator[GenerationChunk]:
        self.params.append(params)
        text = prompt.messages[-1]["content"]
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
        for i, piece in enumerate(pieces):
            yield GenerationChunk(request_id=request_id, text=piece, token_ids=(i,),
                                  finish_reason="stop" if i == len(pieces) - 1 else None, num_prompt_tokens=5,
                                  num_completion_tokens=i + 1)

    async def abort(self, model_id: str, request_id: str) -> None:
        pass

    async def is_ready(self) -> bool:
        return True


@pytest.fixture(scope="module")
def model() -> ScriptedModel:
    return ScriptedModel()


@pytest.fixture(scope="module")
def client(model):
    app = build_gateway_app(model, GatewayAuth(verify_api_key={KEY: "acme"}.get))
    with served_app(app) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=20)


def ask(reply: str) -> list[dict]:
    return [{"role": "user", "content": reply}]


def test_a_whole_reply_with_tool_calls(client):
    got = client.chat.completions.create(model="acme/qwen", messages=ask(REPLY), tools=TOOLS)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Oslo"}), ("function", "get_weather", {"city": "Bergen"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_a_streamed_reply_with_tool_calls_reassembles_to_the_same(client):
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="acme/qwen", messages=ask(REPLY), tools=TOOLS, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            if call.id:
                assert entry["id"] is None  # the id comes once, with the name
                entry["id"] = call.id
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]
    # The markup never reached the client as content, not even in part.
    assert "<tool" not in content


def test_without_tools_or_with_tool_choice_none_the_reply_is_text(client):
    for kwargs in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        choice = client.chat.completions.create(model="acme/qwen", messages=ask(REPLY), **kwargs).choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (REPLY, None, "stop")


def test_plain_text_with_tools_stays_content(client):
    choice = client.chat.completions.create(model="acme/qwen", messages=ask("It is sunny <tool"),
                                            tools=TOOLS).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("It is sunny <tool", None,
                                                                                         "stop")


def test_tools_for_a_model_without_a_known_format_is_a_400_saying_what_to_do(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="acme/plain", messages=ask("hi"), tools=TOOLS)
    error = info.value.body
    assert error["param"] == "tool_choice" and "--tool-call-parser" in error["message"]
    assert client.chat.completions.create(model="acme/plain", messages=ask("hi"), tools=TOOLS,
                                          tool_choice="none").choices[0].message.content == "hi"


def test_mistral_calls_keep_the_special_token_they_start_with(client, model):
    reply = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    choice = client.chat.completions.create(model="acme/mistral", messages=ask(reply), tools=TOOLS).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    # [TOOL_CALLS] is a special token in Mistral's tokenizers: the worker was asked to keep its text.
    assert model.params[-1].skip_special_tokens is False
    client.chat.completions.create(model="acme/mistral", messages=ask("hi"))
    assert model.params[-1].skip_special_tokens is True


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice, reply", [
    (NAMED, '{"city": "Oslo"}'),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'),
])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_are_constrained_json_read_back_into_calls(client, model, tool_choice, reply, stream):
    # Forcing works for any model, whatever format its template teaches: acme/plain knows none.
    kwargs = dict(model="acme/plain", messages=ask(reply), tools=TOOLS, tool_choice=tool_choice)
    if stream:
        calls, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for call in chunk.choices[0].delta.tool_calls or []:
                calls[call.index] = (call.function.name, json.loads(call.function.arguments))
            finish = chunk.choices[0].finish_reason or finish
        got = [calls[i] for i in sorted(calls)]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        finish = choice.finish_reason
        assert choice.message.content is None
    assert got == [("get_weather", {"city": "Oslo"})] and finish == "tool_calls"
    # The worker was asked to constrain the output to exactly that JSON.
    grammar = model.params[-1].structured_output
    schema = grammar.value()
    # Compact JSON: the calls are read by the gateway, no token goes to layout.
    assert schema.pop("x-guidance") == {"whitespace_flexible": False}
    if tool_choice == "required":
        assert schema["type"] == "array" and (schema["minItems"], schema["maxItems"]) == (1, 8)
        assert schema["items"]["properties"]["name"] == {"const": "get_weather"}
        assert schema["items"]["properties"]["parameters"] == TOOLS[0]["function"]["parameters"]
    else:
        assert schema == TOOLS[0]["function"]["parameters"]


def test_required_without_parallel_calls_allows_exactly_one(client, model):
    client.chat.completions.create(model="acme/plain", messages=ask('[{"name": "get_weather", "parameters": {}}]'),
                                   tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert model.params[-1].structured_output.value()["maxItems"] == 1


def test_forced_calls_with_a_response_format_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="acme/plain", messages=ask("{}"), tools=TOOLS, tool_choice="required",
                                       response_format={"type": "json_object"})
    assert info.value.body["param"] == "tool_choice"
