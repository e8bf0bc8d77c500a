"""Log-probabilities and the sampling extras through the gateway (real HTTP, the official `openai`
client) against `transformers` on the same tiny checkpoint.

Log-probabilities are ``log_softmax`` of transformers' fp32 logits at each generated position
(within 1e-4), with the same top-N tokens, on both endpoints, streamed and not. Penalties and a
logit bias on a greedy request change the output exactly as transformers' logits processors do.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from infra.gateway_app import build_gateway_app
from infra.gateway_auth import GatewayAuth
from infra.local_engine_backend import LocalEngineBackend
from infra.threaded_server import served_app
from worker import AsyncEngine, DemoModelConfig, Engine, EngineConfig, write_demo_model

MODEL, KEY = "demo/logprobs", "key-logprobs"
PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Name a colour."}]
MAX_TOKENS, TOP = 6, 3
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    model_dir = write_demo_model(tmp_path_factory.mktemp("logprobs") / "tiny", DemoModelConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=256, init_std=0.1, seed=4))
    engine = Engine(model_dir, EngineConfig(block_size=4, num_kv_blocks=64, dtype="float32"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    async_engine = AsyncEngine(engine)
    app = build_gateway_app(LocalEngineBackend({MODEL: async_engine}), GatewayAuth(verify_api_key={KEY: "demo"}.get))
    try:
        with served_app(app) as base_url:
            yield engine, reference, openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=20)
    finally:
        async_engine.shutdown()


def expected_logprobs(engine, reference, prompt_ids: list[int], num_tokens: int):
    """transformers' greedy continuation, and per position (token, its logprob, the top-N tokens
    with theirs), tokens as the engine decodes each alone."""
    ids = list(prompt_ids)
    steps = []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = reference(torch.tensor([ids])).logits[0, -1].float()  # [V]
            logprobs = torch.log_softmax(logits, dim=-1)
            token = int(torch.argmax(logits))
            top = torch.topk(logprobs, TOP)
            steps.append((engine.tokenizer.decode([token], skip_special_tokens=False), float(logprobs[token]),
                          [engine.tokenizer.decode([int(t)], skip_special_tokens=False) for t in top.indices],
                          [float(v) for v in top.values]))
            ids.append(token)
    return steps


def check(got: list[tuple[str, float, list[str], list[float]]], want) -> None:
    assert len(got) == len(want)
    for (token, logprob, top_tokens, top_values), (w_token, w_logprob, w_top_tokens, w_top_values) in zip(got, want):
        assert token == w_token and abs(logprob - w_logprob) < TOLERANCE
        assert top_tokens == w_top_tokens
        assert max(abs(a - b) for a, b in zip(top_values, w_top_values)) < TOLERANCE


def chat_entries(content) -> list:
    return [(c.token, c.logprob, [t.token for t in c.top_logprobs], [t.logprob for t in c.top_logprobs])
            for c in content]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_transformers(served, stream):
    engine, reference, client = served
    want = expected_logprobs(engine, reference, engine.tokenizer.encode_chat(CHAT), MAX_TOKENS)
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=TOP,
                  extra_body={"ignore_eos": True})
    if stream:
        content = []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                content.extend(chunk.choices[0].logprobs.content)
    else:
        content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    check(chat_entries(content), want)
    assert all(c.bytes == list(c.token.encode()) for c in content)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_transformers(served, stream):
    engine, reference, client = served
    want = expected_logprobs(engine, reference, engine.tokenizer.encode(PROMPT), MAX_TOKENS)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=TOP,
                  extra_body={"ignore_eos": True})
    tokens, values, tops, offsets, text = [], [], [], [], ""
    responses = client.completions.create(stream=True, **kwargs) if stream else [client.completions.create(**kwargs)]
    for response in responses:
        if response.choices and response.choices[0].logprobs is not None:
            lp = response.choices[0].logprobs
            tokens += lp.tokens
            values += lp.token_logprobs
            tops += lp.top_logprobs
            offsets += lp.text_offset
        text += response.choices[0].text if response.choices else ""
    check([(t, v, list(top), list(top.values())) for t, v, top in zip(tokens, values, tops)], want)
    # Each token's offset is where it starts in the completion's text.
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_completion_logprobs_zero_still_gives_each_tokens_own(served):
    engine, reference, client = served
    want = expected_logprobs(engine, reference, engine.tokenizer.encode(PROMPT), 2)
    lp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=0,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    assert lp.tokens == [w[0] for w in want] and lp.top_logprobs == [{}, {}]
    assert all(abs(a - w[1]) < TOLERANCE for a, w in zip(lp.token_logprobs, want))


def test_penalties_and_bias_match_transformers_processors(served):
    engine, reference, client = served
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    prompt_ids = engine.tokenizer.encode(PROMPT)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    banned = engine.tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[0]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    logit_bias={str(banned): -100},
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5),
                                      SequenceBiasLogitsProcessor({(banned,): -100.0})])
    with torch.no_grad():
        # An explicit mask: the demo's BOS is id 0, which generate would otherwise take for padding.
        inputs = torch.tensor([prompt_ids])
        out = reference.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=8, do_sample=False,
                                 logits_processor=processors, eos_token_id=None, pad_token_id=0)
    want = engine.tokenizer.decode(out[0, len(prompt_ids):].tolist())
    assert got.choices[0].text == want and banned not in out[0, len(prompt_ids):].tolist()
    assert got.choices[0].text != plain.choices[0].text


def test_n_seeded_choices_are_reproducible_and_each_is_its_seed(served):
    _, _, client = served
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    first = client.completions.create(n=4, seed=7, **kwargs)
    again = client.completions.create(n=4, seed=7, **kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # four samples, not one repeated
    # Choice i is the request with seed 7 + i.
    assert texts == [client.completions.create(seed=7 + i, **kwargs).choices[0].text for i in range(4)]
    assert first.usage.completion_tokens == 32 and first.usage.prompt_tokens == len(
        served[0].tokenizer.encode(PROMPT))


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
RUNS = 20


def valid_weather(arguments: dict) -> bool:
    return (set(arguments) == {"city", "days"} and isinstance(arguments["city"], str) and len(arguments["city"]) <= 12
            and type(arguments["days"]) is int and 1 <= arguments["days"] <= 7)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_from_a_random_model_always_parse(served, tool_choice):
    _, _, client = served
    for seed in range(RUNS):
        # One call (parallel_tool_calls false): its longest form (~75 characters) fits the tiny
        # model's 256-token context, which up to 8 parallel calls of a random walk would not.
        choice = client.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER, TIME],
                                                tool_choice=tool_choice, temperature=1.0, seed=seed,
                                                parallel_tool_calls=False, max_tokens=200).choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        assert len(calls) == 1
        for name, arguments in calls:
            if isinstance(tool_choice, dict) or name == "get_weather":
                assert name == "get_weather" and valid_weather(arguments), (seed, arguments)
            else:
                assert name == "get_time" and arguments in ({"zone": "UTC"}, {"zone": "CET"}), (seed, arguments)


def test_a_json_schema_response_format_from_a_random_model_always_validates(served):
    _, _, client = served
    schema = WEATHER["function"]["parameters"]
    for seed in range(RUNS):
        got = client.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=1.0, seed=seed, max_tokens=400,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}})
        assert got.choices[0].finish_reason == "stop"
        assert valid_weather(json.loads(got.choices[0].message.content)), seed


def test_n_choices_share_the_prompts_kv_blocks(served):
    engine, _, client = served
    prompt = "The same long opening line, shared by every choice of this one request: " + PROMPT
    num_prompt = len(engine.tokenizer.encode(prompt))
    block = engine.block_manager.block_size
    # Each later choice finds the prompt's full blocks cached, up to the block holding its last token.
    shared = (num_prompt - 1) // block * block
    before = engine.block_manager.num_prefix_hit_tokens
    got = client.completions.create(model=MODEL, prompt=prompt, n=4, seed=1, max_tokens=4, temperature=1.0,
                                    extra_body={"ignore_eos": True})
    assert len(got.choices) == 4 and shared >= 2 * block
    assert engine.block_manager.num_prefix_hit_tokens - before == 3 * shared
    # Usage counts the prompt once; the first choice computed it.
    assert got.usage.prompt_tokens == num_prompt
    # A second request with the same prompt is served from the cache, and says so.
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == shared
