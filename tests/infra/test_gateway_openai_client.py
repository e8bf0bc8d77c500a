"""End to end over real HTTP: uvicorn serving the gateway app over `LocalEngineBackend` on a
tiny demo Llama, called with the official `openai` client as a user would.

Greedy outputs are compared with the same engine run directly (before it starts serving), and
usage with the tokenizer's own counts. The server runs on a free port in a background thread;
"up" is a /healthz poll with a deadline, and "the engine freed the request" is a poll of its
block manager with a deadline — nothing waits on a sleep.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import uvicorn

from infra.gateway_app import build_gateway_app
from infra.gateway_auth import GatewayAuth
from infra.gateway_backend import GatewayBackend
from infra.local_engine_backend import LocalEngineBackend
from infra.threaded_server import free_socket, wait_healthy
from worker import AsyncEngine, DemoModelConfig, Engine, EngineConfig, SamplingParams, write_demo_model

MODEL = "demo/tiny"
KEY = "key-demo"
PROMPT = "Once upon a time"
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is the capital?"}]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
DEADLINE_S = 20.0


class RecordingBackend(LocalEngineBackend):
    """The local backend, noting which requests the gateway aborted."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.aborted: list[str] = []

    async def abort(self, model_id: str, request_id: str) -> None:
        self.aborted.append(request_id)
        await super().abort(model_id, request_id)


class Platform:
    """What the tests need to see: the engine, its greedy references, the backend, the URL."""

    def __init__(self, engine: Engine, backend: RecordingBackend, base_url: str, references: dict) -> None:
        self.engine = engine
        self.backend = backend
        self.base_url = base_url
        self.references = references

    def client(self, api_key: str = KEY, base_url: str | None = None) -> openai.OpenAI:
        # No retries: a 429/503 must reach the test, not be retried behind its back.
        return openai.OpenAI(base_url=base_url or f"{self.base_url}/v1", api_key=api_key, max_retries=0,
                             timeout=DEADLINE_S)

    def wait_until_idle(self) -> None:
        """Polls (deadline) until the engine holds no request and every KV block is free again."""
        manager, deadline = self.engine.block_manager, time.monotonic() + DEADLINE_S
        while self.engine.num_unfinished_requests or manager.num_free_blocks != manager.num_blocks:
            assert time.monotonic() < deadline, "the engine did not free the request's KV blocks in time"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def platform(tmp_path_factory) -> Iterator[Platform]:
    model_dir = write_demo_model(tmp_path_factory.mktemp("gateway") / "tiny", DemoModelConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=256, init_std=0.1, seed=3))
    engine = Engine(model_dir, EngineConfig(block_size=4, num_kv_blocks=128))
    # The references come from the engine itself, one request at a time, before it serves.
    references = {
        "completion": engine.generate([PROMPT], GREEDY)[0],
        "chat": engine.generate([CHAT], GREEDY)[0],
    }
    async_engine = AsyncEngine(engine)
    backend = RecordingBackend({MODEL: async_engine})
    app = build_gateway_app(backend, GatewayAuth(verify_api_key={KEY: "demo"}.get))
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="gateway-uvicorn", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        wait_healthy(base_url, thread)
        yield Platform(engine, backend, base_url, references)
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)
        async_engine.shutdown()
        sock.close()
    assert not thread.is_alive(), "uvicorn did not shut down"


def test_completion_equals_the_engine_and_counts_usage(platform):
    want = platform.references["completion"]
    got = platform.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert got.model == MODEL and got.object == "text_completion"
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    prompt_ids = platform.engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    assert got.usage.prompt_tokens == len(prompt_ids) == want.num_prompt_tokens
    assert got.usage.completion_tokens == len(want.output_token_ids) == MAX_TOKENS
    assert got.usage.total_tokens == len(prompt_ids) + MAX_TOKENS


def test_completion_stream_equals_the_engine(platform):
    want = platform.references["completion"]
    stream = platform.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == want.num_prompt_tokens


def test_chat_equals_the_engine_and_counts_usage(platform):
    want = platform.references["chat"]
    got = platform.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS,
                                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    chat_ids = platform.engine.tokenizer.encode_chat(CHAT, add_generation_prompt=True)
    assert got.usage.prompt_tokens == len(chat_ids) == want.num_prompt_tokens
    assert got.usage.completion_tokens == MAX_TOKENS


def test_chat_stream_on_the_per_model_route_equals_the_engine(platform):
    want = platform.references["chat"]
    client = platform.client(base_url=f"{platform.base_url}/models/{MODEL}/v1")
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [m.id for m in client.models.list()] == [MODEL]


def test_local_backend_checks_ids_and_meets_the_protocol(platform):
    assert isinstance(platform.backend, GatewayBackend)
    with pytest.raises(ValueError, match="tenant/model"):
        LocalEngineBackend({"no-tenant": None})
    assert asyncio.run(platform.backend.list_models("someone-else")) == []
    assert asyncio.run(platform.backend.describe_model(MODEL)).max_model_len == platform.engine.max_model_len


def test_models(platform):
    client = platform.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    model = client.models.retrieve(MODEL)
    assert (model.id, model.owned_by) == (MODEL, "demo")


def test_errors_reach_the_client_as_its_exceptions(platform):
    client = platform.client()
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="demo/missing", prompt=PROMPT, max_tokens=2)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        platform.client(api_key="thaw_wrong").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.PermissionDeniedError):
        client.completions.create(model="someone/else", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert info.value.param == "temperature" and "temperature" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="word " * 300, max_tokens=2)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[1, 10**6], max_tokens=2)
    assert info.value.param == "prompt"
    platform.wait_until_idle()


def test_bad_requests_do_not_disturb_a_stream_in_flight(platform):
    want = platform.references["completion"]
    client = platform.client()
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text  # the request is in flight on the engine now
    for bad in ({"temperature": -1}, {"prompt": "word " * 300}, {"prompt": [10**6]}, {"model": "demo/missing"}):
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)):
            client.completions.create(**{"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **bad})
    text += "".join(c.choices[0].text for c in chunks)
    assert text == want.text


def test_a_client_that_leaves_early_aborts_and_frees_the_kv_blocks(platform):
    platform.wait_until_idle()
    manager = platform.engine.block_manager
    stream = platform.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    # The request holds KV blocks while it runs (it cannot have finished: 200 tokens were asked for).
    assert manager.num_free_blocks < manager.num_blocks
    stream.close()
    platform.wait_until_idle()
    deadline = time.monotonic() + DEADLINE_S
    while not platform.backend.aborted:  # the gateway's abort arrives as the server sees the disconnect
        assert time.monotonic() < deadline, "the gateway never aborted the request"
        time.sleep(0.01)
    assert platform.backend.aborted[0].startswith("cmpl-")


def test_async_client_streams_concurrently(platform):
    want = platform.references["completion"]

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{platform.base_url}/v1", api_key=KEY, max_retries=0,
                                    timeout=DEADLINE_S)

        async def one() -> str:
            stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream])

        try:
            return await asyncio.gather(*(one() for _ in range(3)))
        finally:
            await client.close()

    assert asyncio.run(main()) == [want.text] * 3
