"""`Engine.stats()`: the engine's load as one typed record, the figures its parts hold; and the
record refuses figures that cannot be."""

from __future__ import annotations

import pytest

from worker import DemoModelConfig, Engine, EngineConfig, SamplingParams, write_demo_model
from worker.engine.engine_stats import EngineStats

TINY_DEMO = DemoModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, max_position_embeddings=256, init_std=0.1)
CONFIG = EngineConfig(block_size=4, num_kv_blocks=12, max_num_batched_tokens=64, max_num_seqs=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine(write_demo_model(tmp_path_factory.mktemp("stats") / "demo", TINY_DEMO), CONFIG)


def test_an_idle_engine_reports_its_whole_pool_free(engine):
    stats = engine.stats()
    assert (stats.num_waiting_requests, stats.num_running_requests) == (0, 0)
    assert stats.num_kv_blocks == stats.num_free_kv_blocks == 12
    assert stats.block_size == 4


def test_the_figures_follow_the_requests_through_a_step(engine):
    for i in range(3):  # two sequence slots: the third waits
        engine.add_request("one two three four five", GREEDY, request_id=f"r{i}")
    queued = engine.stats()
    assert (queued.num_waiting_requests, queued.num_running_requests) == (3, 0)
    engine.step()
    running = engine.stats()
    assert (running.num_waiting_requests, running.num_running_requests) == (1, 2)
    assert running.num_free_kv_blocks < running.num_kv_blocks
    assert running.num_prefix_cache_queried_tokens >= queued.num_prefix_cache_queried_tokens
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.stats()
    assert (done.num_waiting_requests, done.num_running_requests) == (0, 0)


@pytest.mark.parametrize("change, message", [
    (dict(num_running_requests=-1), "num_running_requests must be >= 0"),
    (dict(num_free_kv_blocks=13), "13 free KV blocks of 12"),
    (dict(num_prefix_cache_hit_tokens=9), "more prefix-cache hits than tokens looked up"),
])
def test_figures_that_cannot_be_are_refused(change, message):
    figures = dict(num_waiting_requests=0, num_running_requests=0, num_kv_blocks=12, num_free_kv_blocks=12,
                   block_size=4, num_preemptions=0, num_prefix_cache_queried_tokens=8,
                   num_prefix_cache_hit_tokens=4)
    with pytest.raises(ValueError, match=message):
        EngineStats(**{**figures, **change})
