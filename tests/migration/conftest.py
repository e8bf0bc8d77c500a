"""Two instances of one tiny model for the migration tests, each an `AsyncEngine` stepping on its
own thread (as in a worker) with an `EngineEndpoint` over it; shared by a module, checked idle
(every block free) after each test."""

from __future__ import annotations

import asyncio

import pytest

from migration import EngineEndpoint
from worker import AsyncEngine, DemoModelConfig, Engine, EngineConfig, write_demo_model

TINY_DEMO = DemoModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, max_position_embeddings=1024, init_std=0.1)
NUM_KV_BLOCKS = 160
ENGINE_CONFIG = EngineConfig(block_size=8, num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=32)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("migration") / "demo", TINY_DEMO)


@pytest.fixture(scope="module")
def endpoints(model_dir):
    """(source, destination) endpoints over two running engines."""
    engines = [AsyncEngine(Engine(model_dir, ENGINE_CONFIG)) for _ in range(2)]
    yield EngineEndpoint(engines[0], instance_id="src"), EngineEndpoint(engines[1], instance_id="dst")
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="module")
def unmoved(endpoints):
    """unmoved(prompt, params): what a client receives when the request is not migrated (memoised)."""
    from tests.migration.migration_client import stream_following

    cache = {}

    def run(prompt, params):
        if (prompt, params) not in cache:
            cache[prompt, params] = asyncio.run(stream_following(endpoints[0], {}, "unmoved", prompt, params))
        return cache[prompt, params]

    return run


@pytest.fixture(autouse=True)
def idle_afterwards(request):
    yield
    if "endpoints" not in request.fixturenames:
        return
    for endpoint in request.getfixturevalue("endpoints"):
        tracked, free = asyncio.run(endpoint.async_engine.call(
            lambda engine: (engine.requests.request_ids(), engine.block_manager.num_free_blocks)))
        assert (tracked, free) == ([], NUM_KV_BLOCKS), f"{endpoint.instance_id} was left busy"


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray per test module (reused if already up, and then left running): module scope,
    so later folders' Ray fixtures (which size their own clusters) never find this one up."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    if started_here:
        ray.shutdown()
