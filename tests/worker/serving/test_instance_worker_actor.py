"""The model instance through real Ray: streaming generators, cancellation freeing KV blocks,
concurrent streams batched in one actor, errors reaching the caller with their field, load failure,
and a spare worker that is assigned its model later.

One local Ray for the module (reused if another module already started one, and then left
running). Each stream here is read the way the gateway reads it:
``async for ref in handle.generate.options(num_returns="streaming").remote(...)``.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import ray

from worker import (
    DemoModelConfig, InstanceLoadError, InstanceState, InvalidFieldError, SpareWorkerError, start_instance_worker,
    start_spare_worker, stop_instance_worker, stream_generation, write_demo_model,
)
from worker.serving.instance_worker import as_engine_config

TINY_DEMO = DemoModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, max_position_embeddings=256, init_std=0.1)
NUM_KV_BLOCKS = 48  # 192 KV slots: fewer than the 256-token context
ENGINE_CONFIG = {"block_size": 4, "num_kv_blocks": NUM_KV_BLOCKS}
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
LONG = {"temperature": 0.0, "max_tokens": 150, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "Paged attention stores", "def add(a, b):", "Once upon a time there"]
NAMESPACE = f"thaw-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def local_ray():
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    if started_here:
        ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("instance-actor") / "demo", TINY_DEMO)


@pytest.fixture(scope="module")
def instance(local_ray, model_dir):
    handle = start_instance_worker(
        "inst-ray", "acme/demo", str(model_dir), ENGINE_CONFIG, name="inst-ray", namespace=NAMESPACE,
        node_id=ray.get_runtime_context().get_node_id(), num_cpus=1,
    )
    ray.get(handle.ready.remote(), timeout=60)
    yield handle
    stop_instance_worker(handle)


async def read_stream(handle, request_id, prompt, params=GREEDY):
    """The raw protocol: a streaming call, one ``await ref`` per chunk."""
    stream = handle.generate.options(num_returns="streaming").remote(request_id, prompt, params)
    return [await ref async for ref in stream]


def tokens(chunks) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


async def wait_until_idle(handle, timeout_s=15.0):
    """Polls the actor's stats until no request is open and every KV block is free, or the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await handle.stats.remote()
        if stats.num_ongoing_requests == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks:
            return stats
        if time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.01)


def test_named_actor_reports_its_load(instance, model_dir):
    load = ray.get(instance.ready.remote())
    assert (load.instance_id, load.model_id, load.model_dir) == ("inst-ray", "acme/demo", str(model_dir))
    assert load.num_kv_blocks == NUM_KV_BLOCKS and load.load_s > 0 and load.weights_read.startswith("safetensors")
    same = ray.get_actor("inst-ray", namespace=NAMESPACE)
    assert ray.get(same.health.remote()) is InstanceState.READY


def test_concurrent_greedy_streams_match_each_alone(instance):
    async def main():
        alone = [await read_stream(instance, f"alone-{i}", p) for i, p in enumerate(PROMPTS)]
        together = await asyncio.gather(*(read_stream(instance, f"together-{i}", p) for i, p in enumerate(PROMPTS)))
        return alone, together

    alone, together = asyncio.run(main())
    for solo, batched in zip(alone, together):
        assert len(tokens(solo)) == 12
        assert tokens(batched) == tokens(solo)
        assert "".join(c.text for c in batched) == "".join(c.text for c in solo)
        assert (batched[-1].finish_reason, batched[-1].num_completion_tokens) == ("length", 12)
        assert batched[-1].num_prompt_tokens == solo[-1].num_prompt_tokens
    stats = ray.get(instance.stats.remote())
    assert stats.num_generated_tokens >= 8 * 12 and stats.num_ongoing_requests == 0


def test_ray_cancel_aborts_the_request_and_frees_its_blocks(instance):
    async def main():
        before = await instance.stats.remote()
        bystander = asyncio.create_task(read_stream(instance, "bystander", PROMPTS[0]))
        stream = instance.generate.options(num_returns="streaming").remote("victim", "walk away early", LONG)
        got = 0
        async for ref in stream:
            await ref
            got += 1
            if got == 3:
                break
        during = await instance.stats.remote()
        ray.cancel(stream)
        after = await wait_until_idle(instance)
        alone = await read_stream(instance, "bystander-alone", PROMPTS[0])
        return before, during, after, await bystander, alone

    before, during, after, bystander, alone = asyncio.run(main())
    assert during.num_ongoing_requests >= 1 and during.num_free_kv_blocks < NUM_KV_BLOCKS
    assert (after.num_ongoing_requests, after.num_waiting_requests, after.num_running_requests) == (0, 0, 0)
    assert (after.num_free_kv_blocks, after.num_kv_blocks) == (NUM_KV_BLOCKS, NUM_KV_BLOCKS)
    # The victim was stopped, not run out: it made fewer than its 150 tokens (the bystander made 12).
    assert 3 <= after.num_generated_tokens - before.num_generated_tokens - 12 < 150
    assert tokens(bystander) == tokens(alone)  # the other request never noticed


def test_stream_generation_cancels_when_the_caller_leaves(instance):
    async def main():
        full = [chunk async for chunk in stream_generation(instance, "helper-full", PROMPTS[1], GREEDY)]
        before = await instance.stats.remote()
        partial = stream_generation(instance, "helper-leaver", PROMPTS[1], LONG)
        first = await anext(partial)
        await partial.aclose()  # what the gateway does when its client disconnects
        return full, first, before, await wait_until_idle(instance)

    full, first, before, after = asyncio.run(main())
    assert len(tokens(full)) == 12 and full[-1].finish_reason == "length"
    assert first.token_ids == tuple(tokens(full)[:1])
    assert (after.num_ongoing_requests, after.num_free_kv_blocks) == (0, NUM_KV_BLOCKS)
    assert 1 <= after.num_generated_tokens - before.num_generated_tokens < 150


def test_abort_through_the_actor_ends_the_stream(instance):
    async def main():
        stream = instance.generate.options(num_returns="streaming").remote("to-abort", PROMPTS[2], LONG)
        chunks = [await (await anext(stream))]
        assert await instance.abort.remote("to-abort") is True
        chunks += [await ref async for ref in stream]
        return chunks, await instance.stats.remote()

    chunks, after = asyncio.run(main())
    assert chunks[-1].finish_reason == "abort" and len(tokens(chunks)) < 150
    assert (after.num_ongoing_requests, after.num_free_kv_blocks) == (0, NUM_KV_BLOCKS)


def test_invalid_request_reaches_the_caller_with_its_field(instance):
    async def main():
        raw = instance.generate.options(num_returns="streaming").remote("bad-raw", "hi", {"temperature": -1})
        with pytest.raises(InvalidFieldError) as raw_error:  # Ray's wrapper is an instance of the cause
            async for ref in raw:
                await ref
        with pytest.raises(InvalidFieldError) as helper_error:
            async for _ in stream_generation(instance, "bad-helper", "hi", {"max_tokens": 1000}):
                pass
        return raw_error.value, helper_error.value, await read_stream(instance, "after-bad", PROMPTS[3])

    raw_error, helper_error, good = asyncio.run(main())
    assert (raw_error.field, raw_error.message) == ("temperature", "temperature must be >= 0, got -1")
    assert type(helper_error) is InvalidFieldError and helper_error.field == "max_tokens"
    assert "KV-cache slots" in str(helper_error)
    assert len(tokens(good)) == 12 and good[-1].finish_reason == "length"


def test_load_failure_is_an_error_from_ready_not_a_hung_actor(local_ray, tmp_path):
    handle = start_instance_worker("inst-broken", "acme/missing", str(tmp_path / "nothing-here"), ENGINE_CONFIG,
                                   num_cpus=0)
    try:
        with pytest.raises(InstanceLoadError, match="could not load model 'acme/missing'"):
            ray.get(handle.ready.remote(), timeout=60)
        assert ray.get(handle.health.remote()) is InstanceState.FAILED  # alive, and says why it is useless

        async def main():
            with pytest.raises(InstanceLoadError):
                async for _ in stream_generation(handle, "r", "hello"):
                    pass

        asyncio.run(main())
    finally:
        stop_instance_worker(handle)


def test_bad_engine_config_fails_in_the_caller(local_ray, model_dir):
    with pytest.raises(ValueError, match="unknown engine config field 'num_blocks'"):
        start_instance_worker("inst-x", "acme/demo", str(model_dir), {"num_blocks": 4})


def test_a_spare_worker_takes_one_model_and_then_serves_it_like_a_fresh_one(local_ray, instance, model_dir):
    spare = start_spare_worker(name="spare-1", namespace=NAMESPACE, node_id=ray.get_runtime_context().get_node_id())
    try:
        # warm(): one-time costs paid, 8 MiB for weights and 1 MiB for the KV pool faulted; the process age
        assert ray.get(spare.warm.remote(8 << 20, 1 << 20), timeout=120) > 0
        assert ray.get(spare.health.remote()) is InstanceState.SPARE

        async def before_assignment():
            with pytest.raises(SpareWorkerError, match="no model assigned"):
                async for _ in stream_generation(spare, "r0", "hello"):
                    pass

        asyncio.run(before_assignment())
        ray.get(spare.assign.remote("inst-spare", "acme/demo", str(model_dir), as_engine_config(ENGINE_CONFIG), 1),
                timeout=60)
        load = ray.get(spare.ready.remote(), timeout=60)
        assert (load.instance_id, load.model_id, load.num_kv_blocks) == ("inst-spare", "acme/demo", NUM_KV_BLOCKS)
        with pytest.raises(SpareWorkerError, match="already serves 'acme/demo'"):
            try:
                ray.get(spare.assign.remote("inst-2", "acme/other", str(model_dir), None, 1), timeout=60)
            except ray.exceptions.RayTaskError as exc:
                raise exc.cause from exc

        async def compare():
            return (await read_stream(spare, "s", PROMPTS[0]), await read_stream(instance, "f", PROMPTS[0]))

        from_spare, fresh = asyncio.run(compare())
        assert tokens(from_spare) == tokens(fresh) and len(tokens(fresh)) == 12
        assert ray.get(spare.stats.remote()).instance_id == "inst-spare"
    finally:
        stop_instance_worker(spare)


def test_a_worker_that_lets_its_model_go_is_a_spare_again_and_takes_the_next_model(local_ray, instance, model_dir):
    spare = start_spare_worker(name="spare-2", namespace=NAMESPACE, node_id=ray.get_runtime_context().get_node_id())
    try:
        ray.get(spare.warm.remote(0, 0), timeout=120)
        ray.get(spare.assign.remote("inst-first", "acme/first", str(model_dir), as_engine_config(ENGINE_CONFIG), 1),
                timeout=60)
        ray.get(spare.ready.remote(), timeout=60)
        first = asyncio.run(read_stream(spare, "a", PROMPTS[0]))
        ray.get(spare.release_model.remote(10.0), timeout=60)
        assert ray.get(spare.health.remote()) is InstanceState.SPARE
        ray.get(spare.assign.remote("inst-second", "acme/second", str(model_dir), as_engine_config(ENGINE_CONFIG), 1),
                timeout=60)
        load = ray.get(spare.ready.remote(), timeout=60)
        assert (load.instance_id, load.model_id) == ("inst-second", "acme/second")
        second, fresh = asyncio.run(read_stream(spare, "b", PROMPTS[0])), asyncio.run(read_stream(instance, "c", PROMPTS[0]))
        assert tokens(second) == tokens(first) == tokens(fresh)  # the same weights give the same output again
        stats = ray.get(spare.stats.remote())
        assert (stats.instance_id, stats.num_free_kv_blocks) == ("inst-second", NUM_KV_BLOCKS)
    finally:
        stop_instance_worker(spare)
