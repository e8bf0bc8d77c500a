"""The model-instance worker without Ray: load reporting, streams, field-named errors, abort, suspension, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from wire import GrammarSpec
from worker import (
    DemoModelConfig, Engine, EngineConfig, EngineDeadError, InstanceLoadError, InstanceState, InstanceWorker,
    InvalidFieldError, InvalidRequestError, SamplingParams, write_demo_model,
)
from worker.serving.instance_worker import as_engine_config, as_sampling_params

# Tiny but not near-uniform (init_std 0.1), so greedy argmaxes are not decided by float noise.
TINY_DEMO = DemoModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, max_position_embeddings=256, init_std=0.1)
# 48 blocks x 4 = 192 KV slots, fewer than the 256-token context, so max_tokens can outgrow the cache.
NUM_KV_BLOCKS = 48
ENGINE_CONFIG = {"block_size": 4, "num_kv_blocks": NUM_KV_BLOCKS}
LONG = {"temperature": 0.0, "max_tokens": 150, "ignore_eos": True}
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("instance") / "demo", TINY_DEMO)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The engine run directly, offline: what every stream must reproduce."""
    return Engine(model_dir, EngineConfig(**ENGINE_CONFIG))


@pytest.fixture(scope="module")
def worker(model_dir):
    worker = InstanceWorker("inst-1", "acme/demo", model_dir, ENGINE_CONFIG)
    asyncio.run(worker.ready())
    yield worker
    asyncio.run(worker.shutdown())


async def collect(worker, request_id, prompt, params=GREEDY):
    return [chunk async for chunk in worker.generate(request_id, prompt, params)]


async def wait_until(predicate, timeout_s=10.0):
    """Polls ``predicate`` until it holds or the deadline passes (the engine thread acts on its own time)."""
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    return predicate()


def all_blocks_free(worker) -> bool:
    stats = worker.stats()
    return stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_ongoing_requests == 0


def test_ready_reports_how_the_model_was_loaded(worker, model_dir):
    load = asyncio.run(worker.ready())
    assert (load.instance_id, load.model_id, load.model_dir) == ("inst-1", "acme/demo", str(model_dir))
    assert (load.num_kv_blocks, load.block_size, load.max_model_len) == (NUM_KV_BLOCKS, 4, 256)
    assert load.weights_read.startswith("safetensors: 1 file(s)")
    assert 0 < load.weights_load_s <= load.load_s
    stats = worker.stats()
    assert stats.state is InstanceState.READY and worker.health() == "ready"
    assert (stats.num_ongoing_requests, stats.num_waiting_requests, stats.num_running_requests) == (0, 0, 0)
    assert (stats.num_free_kv_blocks, stats.num_kv_blocks, stats.kv_cache_usage) == (NUM_KV_BLOCKS, NUM_KV_BLOCKS, 0.0)
    assert stats.started_at <= time.time() and stats.load_s == load.load_s
    assert stats.weights_read == load.weights_read


@pytest.mark.parametrize("prompt", ["The quick brown fox", MESSAGES, [1, 300, 42, 7]],
                         ids=["text", "chat", "token-ids"])
def test_stream_matches_the_engine_run_directly(worker, reference, prompt):
    want = reference.generate([prompt], SamplingParams(**GREEDY))[0]
    generated_before = worker.stats().num_generated_tokens

    chunks = asyncio.run(collect(worker, f"req-{type(prompt[0]).__name__}", prompt))

    assert [t for c in chunks for t in c.token_ids] == list(want.output_token_ids)
    assert "".join(c.text for c in chunks) == want.text
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    last = chunks[-1]
    assert (last.num_prompt_tokens, last.num_completion_tokens) == (want.num_prompt_tokens, 8)
    if prompt is MESSAGES:  # rendered with the model's chat template
        assert last.num_prompt_tokens == len(reference.tokenizer.encode_chat(MESSAGES))
    assert worker.stats().num_generated_tokens - generated_before == 8
    assert all_blocks_free(worker)


def test_a_stream_carries_each_tokens_logprobs_for_a_request_that_asks(worker, reference):
    params = {**GREEDY, "logprobs": 3, "repetition_penalty": 1.2, "logit_bias": {"300": 1.5}}
    chunks = asyncio.run(collect(worker, "with-logprobs", "The quick brown fox", params))
    want = reference.generate(["The quick brown fox"], SamplingParams(**params))[0]
    assert [t for c in chunks for t in c.token_ids] == list(want.output_token_ids)
    for chunk in chunks:
        assert chunk.logprobs is not None and len(chunk.logprobs) == len(chunk.token_ids)
        for token_id, lp in zip(chunk.token_ids, chunk.logprobs):
            assert lp.token_id == token_id and len(lp.top_token_ids) == 3 and lp.logprob <= 0.0
            assert lp.token == reference.tokenizer.decode([token_id], skip_special_tokens=False)
    plain = asyncio.run(collect(worker, "without", "The quick brown fox"))
    assert all(chunk.logprobs is None for chunk in plain)
    assert all_blocks_free(worker)


def test_requests_sent_during_the_load_wait_for_it(model_dir, reference):
    want = reference.generate(["Once upon a time"], SamplingParams(**GREEDY))[0]

    async def main():
        worker = InstanceWorker("inst-early", "acme/demo", model_dir, EngineConfig(**ENGINE_CONFIG))
        state_at_start = worker.health()
        chunks = await collect(worker, "early", "Once upon a time")
        await worker.shutdown()
        return state_at_start, chunks

    state_at_start, chunks = asyncio.run(main())
    assert state_at_start is InstanceState.LOADING
    assert tuple(t for c in chunks for t in c.token_ids) == want.output_token_ids


@pytest.mark.parametrize(("prompt", "params", "field", "match"), [
    ("hi", {"temperature": -1}, "temperature", "temperature must be >= 0"),
    ("hi", {"max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1"),
    ("hi", {"top_p": 0.5, "stop": [""]}, "stop", "stop\\[0\\] must be a non-empty string"),
    ("hi", {"temperature": 0, "best_of": 2}, "best_of", "unknown sampling parameter 'best_of'"),
    ("hi", ["max_tokens", 3], "sampling_params", "must be a mapping"),
    ("", GREEDY, "prompt", "must not be empty"),
    ([5, 99999], GREEDY, "prompt", "token ids must be in \\[0, 1024\\)"),
    ([7] * 256, GREEDY, "prompt", "prompt is 256 tokens but the model's context is 256 tokens"),
    ([{"role": "user"}], GREEDY, "messages", "content"),
    ("hi", {"max_tokens": 255}, "max_tokens", "KV-cache slots"),
    ("hi", {"logit_bias": {"1024": 5}}, "logit_bias", "logit_bias token ids must be in \\[0, 1024\\)"),
    ("hi", {"logprobs": 21}, "logprobs", "logprobs must be None \\(off\\) or an integer in \\[0, 20\\]"),
    ("hi", {"structured_output": GrammarSpec.json_schema({"type": "foo"})}, "structured_output",
     "^structured_output: the JSON schema cannot be enforced: Invalid type: foo; change or remove that part"),
], ids=["temperature", "max_tokens", "stop", "unknown", "not-a-mapping", "empty", "token-range", "too-long",
        "bad-message", "over-kv-cache", "logit-bias-vocab", "logprobs", "structured-output"])
def test_invalid_request_names_its_field_and_others_keep_going(worker, reference, prompt, params, field, match):
    want = reference.generate(["a fine prompt"], SamplingParams(**GREEDY))[0]

    async def main():
        good = asyncio.create_task(collect(worker, "good", "a fine prompt"))
        with pytest.raises(InvalidFieldError, match=match) as info:
            await collect(worker, "bad", prompt, params)
        return info.value, await good

    error, good_chunks = asyncio.run(main())
    assert isinstance(error, InvalidRequestError) and error.field == field and error.message == str(error)
    assert tuple(t for c in good_chunks for t in c.token_ids) == want.output_token_ids
    assert all_blocks_free(worker)


def test_request_id_in_use_is_refused(worker):
    async def main():
        first = worker.generate("same-id", "walk slowly", LONG)
        await anext(first)
        with pytest.raises(InvalidFieldError, match="already in use") as info:
            await collect(worker, "same-id", "another")
        await first.aclose()
        return info.value

    assert asyncio.run(main()).field == "request_id"
    assert asyncio.run(wait_until(lambda: all_blocks_free(worker)))


def test_abort_ends_the_stream_and_frees_its_blocks(worker, reference):
    want = reference.generate(["bystander"], SamplingParams(**GREEDY))[0]

    async def main():
        bystander = asyncio.create_task(collect(worker, "bystander", "bystander"))
        stream = worker.generate("victim", "this one is cancelled", LONG)
        chunks = [await anext(stream), await anext(stream)]
        assert worker.stats().num_free_kv_blocks < NUM_KV_BLOCKS
        assert worker.abort("victim") is True
        chunks += [chunk async for chunk in stream]
        return chunks, await bystander

    chunks, bystander_chunks = asyncio.run(main())
    assert chunks[-1].finish_reason == "abort" and chunks[-1].token_ids == ()
    assert chunks[-1].num_completion_tokens == sum(len(c.token_ids) for c in chunks) < 150
    assert tuple(t for c in bystander_chunks for t in c.token_ids) == want.output_token_ids
    assert all_blocks_free(worker)  # the engine frees the blocks before it sends the "abort" chunk
    assert worker.abort("victim") is False and worker.abort("never-seen") is False


def test_leaving_the_stream_early_aborts_it(worker):
    async def main():
        stream = worker.generate("leaver", "walk away early", LONG)
        await anext(stream)
        await stream.aclose()
        assert worker.stats().num_ongoing_requests == 0
        return await wait_until(lambda: all_blocks_free(worker))

    assert asyncio.run(main())


def test_load_failure_is_reported_not_hung(tmp_path):
    missing = tmp_path / "no-such-model"

    async def main():
        worker = InstanceWorker("inst-bad", "acme/missing", missing, ENGINE_CONFIG)
        with pytest.raises(InstanceLoadError, match="could not load model 'acme/missing'") as info:
            await worker.ready()
        with pytest.raises(InstanceLoadError):
            await collect(worker, "r", "hello")
        stats = worker.stats()
        await worker.shutdown()
        return info.value, stats, worker.health()

    error, stats, state_after_shutdown = asyncio.run(main())
    assert str(missing) in str(error) and "FileNotFoundError" in str(error)
    assert stats.state is InstanceState.FAILED
    assert (stats.num_kv_blocks, stats.load_s, stats.weights_read) == (0, 0.0, "")
    assert state_after_shutdown is InstanceState.STOPPED


def test_shutdown_ends_open_streams_suspended_and_stops_the_engine_thread(model_dir):
    """"Suspended", not "abort": the gateway continues such a request on the model's next
    instance, so a stop that races a request (the drain did not see it yet) loses nothing."""
    threads_before = set(threading.enumerate())

    async def main():
        worker = InstanceWorker("inst-stop", "acme/demo", model_dir, ENGINE_CONFIG)
        await worker.ready()
        engine_threads = [t for t in threading.enumerate() if t not in threads_before and t.name == "thaw-engine"]
        # The caller keeps reading, as Ray does for the actor: shutdown waits for the streams to close.
        streaming = asyncio.Event()

        async def read_all():
            chunks = []
            async for chunk in worker.generate("open", "still talking", LONG):
                chunks.append(chunk)
                streaming.set()
            return chunks

        reader = asyncio.create_task(read_all())
        await streaming.wait()
        await worker.shutdown()
        chunks = await reader
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(worker, "late", "too late")
        return worker, engine_threads, chunks

    worker, engine_threads, chunks = asyncio.run(main())
    assert len(engine_threads) == 1 and not engine_threads[0].is_alive()
    assert chunks[-1].finish_reason == "suspended" and all(c.finish_reason is None for c in chunks[:-1])
    assert worker.health() is InstanceState.STOPPED and worker.stats().num_ongoing_requests == 0


def test_configs_from_mappings_are_validated():
    assert as_engine_config({"block_size": 8}) == EngineConfig(block_size=8)
    assert as_engine_config(None) == EngineConfig()
    with pytest.raises(ValueError, match="unknown engine config field 'blocksize'"):
        as_engine_config({"blocksize": 8})
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        as_engine_config({"block_size": 0})
    assert as_sampling_params({"max_tokens": 3, "stop": ["\n"]}) == SamplingParams(max_tokens=3, stop=("\n",))


def test_suspend_ends_every_stream_suspended_and_new_ones_at_once(model_dir):
    async def main():
        worker = InstanceWorker("inst-suspend", "acme/demo", model_dir, ENGINE_CONFIG)
        await worker.ready()
        stream = worker.generate("held", "this one gives its slot away", LONG)
        chunks = [await anext(stream), await anext(stream)]
        assert worker.stats().num_requests_started == 1
        assert worker.suspend() == ["held"]
        chunks += [chunk async for chunk in stream]
        late = await collect(worker, "late", "routed here just before the suspension")
        stats = worker.stats()
        await worker.shutdown()
        return chunks, late, stats

    chunks, late, stats = asyncio.run(main())
    assert chunks[-1].finish_reason == "suspended" and all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].num_completion_tokens == sum(len(c.token_ids) for c in chunks) < 150
    assert [(c.finish_reason, c.token_ids) for c in late] == [("suspended", ())]
    assert stats.num_ongoing_requests == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
    assert stats.num_requests_started == 1  # the late one never started here


def test_chunks_carry_the_prompt_tokens_served_from_the_prefix_cache_and_stats_count_them(worker):
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # 13 tokens: 3 full 4-token blocks
    before = worker.stats()
    first = asyncio.run(collect(worker, "cache-first", prompt))
    second = asyncio.run(collect(worker, "cache-second", prompt))
    assert [c.num_cached_tokens for c in first] == [0] * len(first)
    assert [c.num_cached_tokens for c in second] == [12] * len(second)  # all but the last token's block
    assert [t for c in second for t in c.token_ids] == [t for c in first for t in c.token_ids]
    after = worker.stats()
    assert (after.num_prefix_cache_queried_tokens - before.num_prefix_cache_queried_tokens,
            after.num_prefix_cache_hit_tokens - before.num_prefix_cache_hit_tokens) == (26, 12)
    assert all_blocks_free(worker)


def test_sleep_frees_the_kv_pool_refuses_requests_and_wake_serves_the_same_tokens(model_dir, reference):
    """An idle instance sleeps: its KV pool (and prefix cache) freed, its weights kept; a request
    routed to it meanwhile is refused before any token (`EngineDeadError`: the gateway goes
    elsewhere); waking rebuilds the pool, and greedy output is what it was."""
    from worker import InstanceBusyError

    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]

    async def main():
        worker = InstanceWorker("inst-sleep", "acme/demo", model_dir, ENGINE_CONFIG)
        await worker.ready()
        before = await collect(worker, "before", prompt)
        stream = worker.generate("open", "a request in flight", LONG)
        await anext(stream)
        with pytest.raises(InstanceBusyError, match="1 open request"):
            await worker.sleep()
        await stream.aclose()
        assert await wait_until(lambda: all_blocks_free(worker))
        engine = (await worker.serving_engine()).engine
        pool_bytes = engine.runner.kv_pool_bytes
        freed = await worker.sleep()
        asleep = (worker.health(), engine.runner.kv_pool_bytes, engine.block_manager.num_cached_blocks)
        with pytest.raises(EngineDeadError, match="asleep"):
            await collect(worker, "refused", prompt)
        await worker.wake()
        after = await collect(worker, "after", prompt)
        state = worker.health()
        await worker.shutdown()
        return before, after, pool_bytes, freed, asleep, state

    before, after, pool_bytes, freed, asleep, state = asyncio.run(main())
    assert freed == pool_bytes > 0
    assert asleep == (InstanceState.ASLEEP, 0, 0)  # pool and the prefix cache naming its blocks gone
    assert [t for c in after for t in c.token_ids] == [t for c in before for t in c.token_ids]
    assert after[-1].num_cached_tokens == 0  # nothing cached survived the sleep
    assert state is InstanceState.READY
