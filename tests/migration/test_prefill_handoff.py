"""A prefill waiting at the loaded frontier on an instance still receiving its weights, handed to a
fully loaded helper between two running engines: the client, following the request, receives
exactly the unmoved output (greedy and seeded) one hand-off later, while the weights are still
missing; a helper that refuses or dies leaves the request whole on the new instance, which
prefills it again once its layers land; nothing is left behind on either side."""

from __future__ import annotations

import asyncio
import time

import pytest

from migration import EngineEndpoint, MigrationMethod, MigrationRefusedError, MigrationStatus, hand_over_prefill
from tests.migration.migration_client import FaultyEndpoint, stream_following
from tests.worker.loading.test_layer_gate import FakeLayerSource, config_only, engine_config, land
from tests.worker.loading.test_layer_gate import tied_dir  # noqa: F401 - the fixture
from worker import AsyncEngine, Engine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
PROMPT = list(range(10, 17))  # 7 tokens: one layer-by-layer pass
DEADLINE_S = 30  # a guard so a bug fails the test instead of hanging it


@pytest.fixture()
def instances(tied_dir, tmp_path):  # noqa: F811
    """(weights source, new instance's endpoint, helper's endpoint); layers -1..1 have landed on
    the new instance, 2.. have not."""
    source = FakeLayerSource(tied_dir)
    receiver = AsyncEngine(Engine(config_only(tied_dir, tmp_path), engine_config(), weights=source))
    land(source, receiver.engine.runner.layer_gate, -1, 0, 1)
    helper = AsyncEngine(Engine(tied_dir, engine_config()))
    yield source, EngineEndpoint(receiver, instance_id="new"), EngineEndpoint(helper, instance_id="helper")
    source.release_all()
    for engine in (receiver, helper):
        engine.shutdown()


def unmoved(model_dir, params) -> list[int]:
    return list(Engine(model_dir, engine_config()).generate([PROMPT], params)[0].output_token_ids)


async def at_frontier(endpoint: EngineEndpoint, request_id: str, layer: int) -> None:
    """Returns once `request_id`'s pass waits at `layer` (polled between engine steps)."""
    def waiting(engine) -> bool:
        layer_pass = engine.requests.layer_pass(request_id) if request_id in engine.requests else None
        return layer_pass is not None and layer_pass.next_layer == layer

    deadline = time.monotonic() + DEADLINE_S
    while not await endpoint.async_engine.call(waiting):
        assert time.monotonic() < deadline, f"{request_id} never reached layer {layer}"
        await asyncio.sleep(0.01)


async def idle(endpoint: EngineEndpoint) -> tuple[list[str], int, int]:
    return await endpoint.async_engine.call(lambda engine: (
        engine.requests.request_ids(), engine.block_manager.num_free_blocks, engine.block_manager.num_blocks))


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_helper_takes_the_waiting_prefill_and_the_client_gets_the_unmoved_output(
        instances, tied_dir, params):  # noqa: F811
    expected = unmoved(tied_dir, params)
    source, new, helper = instances

    async def scenario():
        client = asyncio.create_task(stream_following(new, {"helper": helper}, "r", PROMPT, params))
        await at_frontier(new, "r", 2)
        outcome = await hand_over_prefill(new, helper, "r")
        return outcome, await asyncio.wait_for(client, DEADLINE_S), await idle(new)

    outcome, received, (tracked, free, total) = asyncio.run(scenario())
    assert outcome.status is MigrationStatus.MIGRATED, outcome.error
    assert outcome.method is MigrationMethod.LAYER
    assert received.token_ids == expected and received.finish_reason == "length"
    assert received.num_handoffs == 1
    # The KV of layers -1..1 travelled: [2 layers, 2, blocks of the 7-token prompt, ...].
    assert outcome.num_blocks_copied == -(-len(PROMPT) // engine_config().block_size)
    # Served while layers 2.. never arrived at the new instance, which kept nothing of it.
    assert not new.async_engine.engine.weights_resident
    assert tracked == [] and free == total


def hand_over_then_land(instances, target, prompt, params, *, requeued: bool = False):
    """Streams ``prompt`` from the new instance, hands its prefill waiting at layer 2 to ``target``
    (the helper, or a faulty stand-in for it), then lands the missing layers; returns (outcome,
    what the client received, the real helper's (tracked, free, total) afterwards). ``requeued``:
    first waits for the new instance to have queued the prompt again and brought it back to the frontier."""
    source, new, helper = instances

    async def scenario():
        client = asyncio.create_task(stream_following(new, {"helper": helper}, "r", prompt, params))
        await at_frontier(new, "r", 2)
        outcome = await hand_over_prefill(new, target, "r")
        if requeued:  # a fresh pass runs the landed layers and waits again
            await at_frontier(new, "r", 2)
        await asyncio.to_thread(source.release_all)
        return outcome, await asyncio.wait_for(client, DEADLINE_S), await idle(helper)

    return asyncio.run(scenario())


def test_a_helper_that_refuses_leaves_the_request_to_finish_on_the_new_instance(
        instances, tied_dir):  # noqa: F811
    expected = unmoved(tied_dir, GREEDY)
    refusing = FaultyEndpoint(instances[2], "take_over_prefill", MigrationRefusedError("needs 2 KV blocks, 0 free"))
    outcome, received, (tracked, free, total) = hand_over_then_land(instances, refusing, PROMPT, GREEDY,
                                                                    requeued=True)
    assert outcome.status is MigrationStatus.REFUSED and "0 free" in outcome.error
    assert received.token_ids == expected and received.num_handoffs == 0
    assert tracked == [] and free == total


@pytest.mark.parametrize("after_forwarding", [False, True], ids=["before", "after-taking-it"])
def test_a_helper_dying_mid_hand_over_keeps_nothing_and_the_request_finishes_whole(
        instances, tied_dir, after_forwarding):  # noqa: F811
    expected = unmoved(tied_dir, SEEDED)
    dying = FaultyEndpoint(instances[2], "take_over_prefill", ConnectionError("instance died"),
                           after_forwarding=after_forwarding)
    outcome, received, (tracked, free, total) = hand_over_then_land(instances, dying, PROMPT, SEEDED)
    assert outcome.status is MigrationStatus.FAILED and "instance died" in outcome.error
    assert received.token_ids == expected and received.num_handoffs == 0
    assert tracked == [] and free == total  # a helper that had taken it dropped it again


def test_a_prompt_spanning_several_passes_is_refused_by_the_new_instance_unchanged(
        instances, tied_dir):  # noqa: F811
    long_prompt = list(range(5, 45))  # 40 tokens: more than one 32-token pass
    expected = list(Engine(tied_dir, engine_config()).generate([long_prompt], GREEDY)[0].output_token_ids)
    outcome, received, (tracked, free, total) = hand_over_then_land(instances, instances[2], long_prompt, GREEDY)
    assert outcome.status is MigrationStatus.REFUSED and "spans several passes" in outcome.error
    assert received.token_ids == expected and received.num_handoffs == 0
    assert tracked == [] and free == total
