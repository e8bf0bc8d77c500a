"""Chat through the gateway (real HTTP, the official `openai` client) for a model whose chat
templates live only in files, as transformers 5 saves them: the default in ``chat_template.jinja``
and a ``tool_use`` one in ``additional_chat_templates/``. The gateway answers what the engine
renders from those files; a request with ``tools`` gets the tool template, which lists the tools,
renders earlier calls with their arguments as objects, and reads a ``chat_template_kwargs`` switch."""

from __future__ import annotations

import json

import openai
import pytest

from infra.gateway_app import build_gateway_app
from infra.gateway_auth import GatewayAuth
from infra.local_engine_backend import LocalEngineBackend
from infra.threaded_server import served_app
from wire import ChatPrompt
from worker import AsyncEngine, DemoModelConfig, Engine, EngineConfig, SamplingParams, write_demo_model

MODEL, KEY = "demo/jinja", "key-jinja"
TEMPLATE = ("{%- for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}{%- endfor %}"
            "{%- if add_generation_prompt %}[ASSISTANT]{%- endif %}")
TOOL_TEMPLATE = (
    "{%- if tools %}[TOOLS]{% for t in tools %} {{ t.function.name }}{% endfor %}{{ eos_token }}{% endif %}"
    "{%- for m in messages %}[{{ m['role'] | upper }}] "
    "{%- if m.content %}{{ m.content | upper if shout else m.content }}{% endif %}"
    "{%- for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>"
    "{%- endfor %}{{ eos_token }}{%- endfor %}"
    "{%- if add_generation_prompt %}[ASSISTANT]{%- endif %}")
CHAT = [{"role": "user", "content": "Name a colour."}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
]
# TOOL_CHAT as the engine takes it: arguments as objects, as the gateway hands them to templates.
TOOL_PROMPT = ChatPrompt(messages=(
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "cold"}), tools=(TOOL,), template_kwargs={"shout": True})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = write_demo_model(tmp_path_factory.mktemp("jinja") / "tiny", DemoModelConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=256, init_std=0.1, seed=4))
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)  # only the file carries it now
    config_path.write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    (model_dir / "additional_chat_templates").mkdir()
    (model_dir / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_TEMPLATE)
    engine = Engine(model_dir, EngineConfig(block_size=4, num_kv_blocks=64))
    # The references are generated before AsyncEngine's thread owns the engine: a direct
    # `generate` while that thread steps would race it on the scheduler and the block pool.
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = {"chat": engine.generate([CHAT], greedy)[0], "tool": engine.generate([TOOL_PROMPT], greedy)[0]}
    async_engine = AsyncEngine(engine)
    app = build_gateway_app(LocalEngineBackend({MODEL: async_engine}), GatewayAuth(verify_api_key={KEY: "demo"}.get))
    try:
        with served_app(app) as base_url:
            yield engine, want, openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=20)
    finally:
        async_engine.shutdown()


def test_chat_uses_the_template_file(served):
    engine, want, client = served
    rendered = engine.tokenizer.apply_chat_template(CHAT)
    assert rendered.startswith("[USER] Name a colour.") and rendered.endswith("[ASSISTANT]")
    got = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want["chat"].text
    assert got.usage.prompt_tokens == len(engine.tokenizer.encode(rendered, add_special_tokens=False))


def test_chat_with_tools_and_a_template_kwarg_uses_the_tool_template(served):
    engine, want, client = served
    prompt = TOOL_PROMPT
    rendered = engine.tokenizer.apply_chat_template(list(prompt.messages), tools=prompt.tools,
                                                    template_kwargs=prompt.template_kwargs)
    (eos,) = engine.tokenizer.convert_ids_to_tokens(engine.tokenizer.eos_token_ids[:1])
    assert rendered == (f"[TOOLS] get_weather{eos}[USER]WEATHER IN OSLO?{eos}"
                        f'[ASSISTANT]<call>get_weather {{"city": "Oslo"}}</call>{eos}[TOOL]COLD{eos}[ASSISTANT]')
    # tool_choice "none": this template teaches no tool-call format the gateway could parse calls in.
    got = client.chat.completions.create(model=MODEL, messages=TOOL_CHAT, tools=[TOOL], tool_choice="none",
                                         max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True, "chat_template_kwargs": {"shout": True}})
    assert got.choices[0].message.content == want["tool"].text
    assert got.usage.prompt_tokens == len(engine.tokenizer.encode(rendered, add_special_tokens=False))
    # Without the switch the template renders the messages as they are: a different prompt.
    quiet = client.chat.completions.create(model=MODEL, messages=TOOL_CHAT, tools=[TOOL], tool_choice="none",
                                           max_tokens=1, temperature=0)
    assert quiet.usage.prompt_tokens == len(engine.tokenizer.encode(
        rendered.replace("WEATHER IN OSLO?", "Weather in Oslo?").replace("COLD", "cold"), add_special_tokens=False))
