"""Chat through the gateway (real HTTP, the official `openai` client) for a model whose chat
template lives only in ``chat_template.jinja``, as transformers 5 saves it: the gateway answers
what the engine renders from that file, and the rendered prompt is the file's, not a default."""

from __future__ import annotations

import json
import threading

import openai
import pytest
import uvicorn

from infra.gateway_app import build_gateway_app
from infra.gateway_auth import GatewayAuth
from infra.local_engine_backend import LocalEngineBackend
from tests.infra.test_gateway_openai_client import _free_socket, _wait_healthy
from worker import AsyncEngine, DemoModelConfig, Engine, EngineConfig, SamplingParams, write_demo_model

MODEL, KEY = "demo/jinja", "key-jinja"
TEMPLATE = ("{%- for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}{%- endfor %}"
            "{%- if add_generation_prompt %}[ASSISTANT]{%- endif %}")
CHAT = [{"role": "user", "content": "Name a colour."}]


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
    engine = Engine(model_dir, EngineConfig(block_size=4, num_kv_blocks=64))
    want = engine.generate([CHAT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    async_engine = AsyncEngine(engine)
    app = build_gateway_app(LocalEngineBackend({MODEL: async_engine}), GatewayAuth(verify_api_key={KEY: "demo"}.get))
    sock = _free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        _wait_healthy(base_url, thread)
        yield engine, want, openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=20)
    finally:
        server.should_exit = True
        thread.join(20)
        async_engine.shutdown()
        sock.close()


def test_chat_uses_the_template_file(served):
    engine, want, client = served
    rendered = engine.tokenizer.apply_chat_template(CHAT)
    assert rendered.startswith("[USER] Name a colour.") and rendered.endswith("[ASSISTANT]")
    got = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(engine.tokenizer.encode(rendered, add_special_tokens=False))
