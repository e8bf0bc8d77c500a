"""A slot host without Ray (`worker.SlotHost`): two models assigned into one process, each served
through the host's ``call`` / ``stream`` exactly as its own actor would serve it, their engines
taking turns at stepping; unloading one leaves the other; a call for an instance the host does not
hold is a gone actor's error; a full host refuses another."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from wire import ActorGoneError
from worker import DemoModelConfig, Engine, EngineConfig, SamplingParams, SpareWorkerError, write_demo_model
from worker.serving.slot_host import SlotHost

TINY = DemoModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, max_position_embeddings=256, init_std=0.1)
CONFIG = EngineConfig(block_size=4, num_kv_blocks=64)
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("host")
    return {name: write_demo_model(root / name, dataclasses.replace(TINY, seed=seed))
            for name, seed in (("a", 1), ("b", 2))}


def reference(model_dir, prompt) -> list[int]:
    [completion] = Engine(model_dir, CONFIG).generate([prompt], SamplingParams(**GREEDY))
    return list(completion.output_token_ids)


async def tokens(host: SlotHost, instance_id: str, request_id: str, prompt) -> list[int]:
    return [t async for chunk in host.stream(instance_id, "generate", request_id, prompt, GREEDY)
            for t in chunk.token_ids]


def test_two_models_in_one_host_serve_exactly_and_take_turns(models):
    prompt = [5, 6, 7, 8, 9]

    async def main():
        host = SlotHost(max_instances=2)
        await host.warm()
        for name, model_dir in models.items():
            await host.call(f"i-{name}", "assign", f"i-{name}", f"acme/{name}", str(model_dir), CONFIG, 1)
        loads = [await host.call(f"i-{name}", "ready") for name in models]
        assert host.host_instance_ids() == ["i-a", "i-b"]
        both = await asyncio.gather(tokens(host, "i-a", "r1", prompt), tokens(host, "i-b", "r2", prompt))
        with pytest.raises(SpareWorkerError, match="holds 2 instances"):
            await host.call("i-c", "assign", "i-c", "acme/c", str(models["a"]), CONFIG, 1)
        assert host.host_instance_ids() == ["i-a", "i-b"]  # the refused one left nothing behind
        assert await host.unload("i-a") and not await host.unload("i-a")
        with pytest.raises(ActorGoneError, match="i-a is not held by this slot host"):
            await host.call("i-a", "stats")
        after = await tokens(host, "i-b", "r3", prompt)
        stats = await host.call("i-b", "stats")
        turns = host.turns.num_turns
        await host.shutdown()
        return loads, both, after, stats, turns

    loads, (a, b), after, stats, turns = asyncio.run(main())
    assert [load.model_id for load in loads] == ["acme/a", "acme/b"]
    assert a == reference(models["a"], prompt) and b == reference(models["b"], prompt) and a != b
    assert after == b and stats.model_id == "acme/b"
    assert turns >= 3 * 12  # every step of the three requests went through the host's turns
