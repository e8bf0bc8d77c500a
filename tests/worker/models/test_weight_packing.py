"""When a CPU engine pre-packs its linear weights (`worker.models.weight_packing`): at load for a small
model; for one past `cpu_prepack_defer_bytes`, a layer at a time once serving, never while a
request waits for its first token, and while idle in `AsyncEngine`. (Tokens across the switch are
checked against transformers in tests/worker/engine/test_engine_vs_transformers.py, "deferred-packing".)"""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from kernels.cpu_linear import PrepackedLinear, cpu_prepack_unavailable_reason
from worker import DemoModelConfig, Engine, EngineConfig, SamplingParams, write_demo_model
from worker.serving.async_engine import AsyncEngine
from worker.models.weight_packing import linear_weight_bytes

WHY_NOT = cpu_prepack_unavailable_reason(torch.float32, torch.device("cpu"))
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no float32 pre-packing here: {WHY_NOT}")
NUM_LAYERS = 3
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("packing") / "hf",
                            DemoModelConfig(hidden_size=128, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=256, seed=3))


def linears(engine: Engine) -> tuple[int, int]:
    """(plain nn.Linear modules, PrepackedLinear modules) in the engine's model."""
    modules = list(engine.runner.model.modules())
    return (sum(isinstance(m, nn.Linear) for m in modules), sum(isinstance(m, PrepackedLinear) for m in modules))


def test_a_model_under_the_threshold_is_packed_at_load(model_dir):
    engine = Engine(model_dir, EngineConfig(num_kv_blocks=32))  # default threshold: 64 MiB, far above
    packing = engine.packing
    assert packing is not None and not packing.deferred and packing.done
    assert linears(engine) == (0, NUM_LAYERS * 4 + 1)  # qkv, o, gate_up, down per layer + the head
    assert packing.load_s > 0 and packing.later_s == 0
    assert "pre-packed for oneDNN in" in engine.load_report
    assert engine.pack_weights_when_free() == 0  # nothing left


def test_past_the_threshold_packing_waits_for_first_tokens_then_goes_a_layer_at_a_time(model_dir):
    engine = Engine(model_dir, EngineConfig(num_kv_blocks=32, cpu_prepack_defer_bytes=1024))
    packing = engine.packing
    assert packing.deferred and packing.num_bytes == linear_weight_bytes(engine.runner.model) > 1024
    assert linears(engine) == (NUM_LAYERS * 4 + 1, 0) and packing.load_s == 0
    assert "pre-packed for oneDNN layer by layer" in engine.load_report

    engine.add_request("a prompt", PARAMS)
    assert engine.pack_weights_when_free() == 0  # it waits for its first token: nothing is packed
    engine.step()  # the prefill: its first token
    assert linears(engine) == (NUM_LAYERS * 4 + 1, 0)
    assert engine.pack_weights_when_free() == 4  # now layer 0's four linears
    assert linears(engine) == (NUM_LAYERS * 4 - 3, 4)
    engine.add_request("another prompt", PARAMS)
    assert engine.pack_weights_when_free() == 0  # a newcomer waits for its first token again
    while engine.has_unfinished_requests():
        engine.step()
        engine.pack_weights_when_free()
    while not packing.done:
        assert engine.pack_weights_when_free() > 0
    assert linears(engine) == (0, NUM_LAYERS * 4 + 1) and packing.num_pending_layers == 0
    assert packing.later_s > 0
    assert engine.generate(["after"], PARAMS)[0].finish_reason == "length"


def test_an_idle_async_engine_packs_everything_and_answers_calls_between_layers(model_dir):
    async def run() -> None:
        async_engine = AsyncEngine(Engine(model_dir, EngineConfig(num_kv_blocks=32, cpu_prepack_defer_bytes=0)))
        try:
            # No request ever comes: the loop packs on its own, answering calls between layers
            # (each answer sees at least as many packed as the one before).
            seen = [0]
            for _ in range(10_000):  # a bound for a broken loop, not a wait: each call is answered at once
                num_packed, done = await async_engine.call(lambda e: (e.packing.num_packed, e.packing.done))
                assert num_packed >= seen[-1]
                seen.append(num_packed)
                if done:
                    break
            assert await async_engine.call(lambda e: (e.packing.done, linears(e))) == (True, (0, NUM_LAYERS * 4 + 1))
            out = [o async for o in async_engine.generate("hello", PARAMS)]
            assert out[-1].finished and sum(len(o.new_token_ids) for o in out) == PARAMS.max_tokens
        finally:
            async_engine.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("value", [-1, 1.5, True, "64"])
def test_the_threshold_must_be_bytes_or_none(value):
    with pytest.raises(ValueError, match="cpu_prepack_defer_bytes"):
        EngineConfig(cpu_prepack_defer_bytes=value)
