"""The asyncio wrapper: concurrent streams, per-request errors, abort on early exit."""

from __future__ import annotations

import asyncio

import pytest

from worker import AsyncEngine, Engine, EngineConfig, InvalidRequestError, SamplingParams
from worker.serving.async_engine import EngineDeadError

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture()
def engines(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, EngineConfig(block_size=4, num_kv_blocks=128))
    async_engine = AsyncEngine(engine)
    yield engine, async_engine
    async_engine.shutdown()


async def collect(async_engine, prompt, params=PARAMS):
    tokens, text, last = [], "", None
    async for out in async_engine.generate(prompt, params):
        tokens.extend(out.new_token_ids)
        text += out.new_text
        last = out
    return tokens, text, last


def test_concurrent_streams_match_offline_generation(engines, tiny_llama_dir):
    engine, async_engine = engines
    prompts = ["alpha beta", "gamma", "delta epsilon zeta", "eta"]
    expected = Engine(tiny_llama_dir, EngineConfig(block_size=4, num_kv_blocks=128)).generate(prompts, PARAMS)

    async def main():
        return await asyncio.gather(*(collect(async_engine, p) for p in prompts))

    results = asyncio.run(main())
    for (tokens, text, last), want in zip(results, expected):
        assert tokens == list(want.output_token_ids)
        assert text == want.text
        assert last.finished and last.finish_reason == "length" and last.num_output_tokens == 10


def test_bad_request_raises_for_its_caller_only(engines):
    engine, async_engine = engines

    async def main():
        good = asyncio.create_task(collect(async_engine, "a fine prompt"))
        with pytest.raises(InvalidRequestError, match="must not be empty"):
            await collect(async_engine, "")
        return await good

    tokens, _, last = asyncio.run(main())
    assert len(tokens) == 10 and last.finish_reason == "length"


def test_leaving_the_stream_early_aborts_and_frees_blocks(engines):
    engine, async_engine = engines
    long_params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        agen = async_engine.generate("walk away early", long_params)
        got = 0
        async for _ in agen:
            got += 1
            if got == 3:
                break
        await agen.aclose()
        # The engine thread processes the abort; poll with a deadline.
        deadline = asyncio.get_running_loop().time() + 10
        while engine.num_unfinished_requests and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert engine.num_unfinished_requests == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_shutdown_ends_open_streams_with_an_error(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, EngineConfig(block_size=4, num_kv_blocks=128))
    async_engine = AsyncEngine(engine)
    long_params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def main():
        agen = async_engine.generate("still talking", long_params)
        await agen.__anext__()  # the request is running
        await asyncio.to_thread(async_engine.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in agen:
                pass

    assert async_engine.is_alive
    asyncio.run(main())
    assert not async_engine.is_alive and async_engine.error is None
