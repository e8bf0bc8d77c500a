"""A second real client library against the gateway: `langchain-openai`'s `ChatOpenAI` (real HTTP),
for chat, streaming, tools and a JSON-schema response format.

The backend is the scripted one of `test_gateway_tool_calls` (it replies with the last user
message), so what is under test is that the library's requests are accepted as it sends them and
its parsing of our responses gives what a user expects; the engine side of each feature is tested
against transformers elsewhere.
"""

from __future__ import annotations

import pytest

from infra.gateway_app import build_gateway_app
from infra.gateway_auth import GatewayAuth
from infra.threaded_server import served_app
from tests.infra.test_gateway_tool_calls import KEY, REPLY, ScriptedModel
from wire import GrammarSpec

langchain_openai = pytest.importorskip("langchain_openai")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ANSWER_SCHEMA = {"title": "Answer", "description": "a colour and how sure", "type": "object",
                 "properties": {"colour": {"type": "string"}, "sure": {"type": "boolean"}},
                 "required": ["colour", "sure"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served():
    model = ScriptedModel()
    app = build_gateway_app(model, GatewayAuth(verify_api_key={KEY: "acme"}.get))
    with served_app(app) as base_url:
        yield model, base_url


def chat_model(base_url: str, name: str = "acme/qwen", **kwargs):
    return langchain_openai.ChatOpenAI(model=name, base_url=f"{base_url}/v1", api_key=KEY, max_retries=0,
                                       timeout=20, **kwargs)


def test_chat_and_stream(served):
    _, base_url = served
    llm = chat_model(base_url)
    assert llm.invoke("Hello there").content == "Hello there"
    pieces = [chunk.content for chunk in llm.stream("Streamed reply")]
    assert "".join(pieces) == "Streamed reply" and len([p for p in pieces if p]) > 1


def test_tools_bound_and_called(served):
    _, base_url = served
    message = chat_model(base_url).bind_tools([WEATHER]).invoke(REPLY)
    assert message.content == "Let me check."
    assert [(call["name"], call["args"]) for call in message.tool_calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]
    # Streamed, the library assembles the same calls from our deltas.
    chunks = list(chat_model(base_url).bind_tools([WEATHER]).stream(REPLY))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert [(call["name"], call["args"]) for call in merged.tool_calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]


def test_structured_output_with_a_json_schema(served):
    model, base_url = served
    structured = chat_model(base_url, "acme/plain").with_structured_output(ANSWER_SCHEMA, method="json_schema",
                                                                           strict=True)
    assert structured.invoke('{"colour": "teal", "sure": true}') == {"colour": "teal", "sure": True}
    # The library's response_format reached the worker as the grammar to enforce.
    grammar = model.params[-1].structured_output
    assert grammar.kind == "json_schema" and grammar.value()["properties"] == ANSWER_SCHEMA["properties"]
    assert isinstance(grammar, GrammarSpec)
