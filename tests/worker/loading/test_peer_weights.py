"""A new instance fed by a running instance's stream (no Ray): it serves exactly while the layers
land, knows when they are all in, becomes a source itself once it has a node copy, and falls back
to the node's copy when the source is gone."""

from __future__ import annotations

import asyncio
import time

import pytest

from loader import StreamConfig, convert_checkpoint
from worker import InstanceState, InstanceWorker, PeerWeights, SourceUnavailableError
from worker.loading.peer_weights import WeightStreams, model_files

ENGINE_CONFIG = {"block_size": 4, "num_kv_blocks": 64, "layer_timeout_s": 30.0}
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
PROMPTS = ["the cat sat on the", "a dog ran"]
STREAM = StreamConfig(timeout_s=10.0, chunk_bytes=16384)


@pytest.fixture(scope="module")
def thaw_dir(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("peer-weights") / "thaw"
    convert_checkpoint(tiny_llama_dir, out, progress=False)
    return out


async def tokens(worker: InstanceWorker, request_id: str, prompt: str) -> list[int]:
    out: list[int] = []
    async for chunk in worker.generate(request_id, prompt, GREEDY):
        out.extend(chunk.token_ids)
    return out


async def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return predicate()


def test_model_files_carry_config_and_tokenizer_but_no_weights(thaw_dir):
    names = {name for name, _ in model_files(thaw_dir)}
    assert "config.json" in names and any(n.startswith("tokenizer") for n in names)
    assert not any(n.startswith("partition_") for n in names)


def test_a_ticket_refuses_a_rank_outside_the_chain_and_a_path_for_a_file_name(thaw_dir):
    streams = WeightStreams("src", "acme/tiny")
    ticket = streams.open(thaw_dir, 2, StreamConfig(timeout_s=1.0))
    try:
        assert ticket.rank == 1 and ticket.for_rank(2).rank == 2
        with pytest.raises(ValueError, match="receivers 1..2"):
            ticket.for_rank(3)
        with pytest.raises(ValueError, match="not a plain file name"):
            PeerWeights(ticket.source_instance_id, ticket.model_id, ticket.rendezvous, ticket.stream_config,
                        ticket.total_bytes, (("../config.json", b"{}"),))
    finally:
        streams.close()


def test_a_streamed_instance_serves_exactly_and_becomes_a_source_once_it_has_a_node_copy(thaw_dir):
    async def run():
        source = InstanceWorker("src", "acme/tiny", thaw_dir, ENGINE_CONFIG)
        await source.ready()
        want = [await tokens(source, f"want-{i}", p) for i, p in enumerate(PROMPTS)]

        ticket = await source.stream_weights(1, STREAM)
        assert ticket.source_instance_id == "src" and ticket.total_bytes > 0
        fed = InstanceWorker("fed", "acme/tiny", None, ENGINE_CONFIG, peer=ticket)
        load = await fed.ready()  # ready once the engine exists; layers may still be landing
        got = await asyncio.gather(*(tokens(fed, f"got-{i}", p) for i, p in enumerate(PROMPTS)))
        assert got == want
        assert await wait_for(lambda: fed.stats().weights_resident)
        assert "layer by layer" in fed.stats().weights_read and load.model_dir != str(thaw_dir)
        assert "streamed from instance src" in fed.stats().weights_read
        assert await wait_for(lambda: source.stats().num_weight_streams == 0)

        # Without a node copy it cannot vouch for the bytes it would send; with one it can.
        with pytest.raises(SourceUnavailableError, match="no local copy"):
            await fed.stream_weights(1, STREAM)
        fed.supply_fallback(str(thaw_dir))
        with pytest.raises(RuntimeError, match="already supplied"):
            fed.supply_fallback(str(thaw_dir))
        second = InstanceWorker("fed-2", "acme/tiny", None, ENGINE_CONFIG, peer=await fed.stream_weights(1, STREAM))
        await second.ready()
        assert await tokens(second, "again", PROMPTS[0]) == want[0]
        for worker in (second, fed, source):
            await worker.shutdown()

    asyncio.run(run())


def test_a_dead_source_makes_the_instance_wait_for_its_node_copy_and_serve_from_it(thaw_dir):
    async def run():
        reference = InstanceWorker("ref", "acme/tiny", thaw_dir, ENGINE_CONFIG)
        await reference.ready()
        want = await tokens(reference, "want", PROMPTS[0])
        # The source dies before the new instance connects: nothing of the model arrives by stream.
        streams = WeightStreams("gone", "acme/tiny")
        ticket = streams.open(thaw_dir, 1, StreamConfig(timeout_s=1.0, chunk_bytes=16384))
        streams.close()
        fed = InstanceWorker("fed", "acme/tiny", None, ENGINE_CONFIG, peer=ticket)
        await fed.ready()
        request = asyncio.ensure_future(tokens(fed, "got", PROMPTS[0]))
        assert await wait_for(lambda: fed._peer.switched)  # the stream failed; the fallback waits for a path
        assert not request.done() and fed.state is InstanceState.READY
        fed.supply_fallback(str(thaw_dir))
        assert await asyncio.wait_for(request, 30) == want
        assert "the stream from instance gone failed" in fed._peer.fallback_reason
        assert "the rest read from the node's copy" in fed.stats().weights_read
        assert await wait_for(lambda: fed.stats().weights_resident)
        for worker in (fed, reference):
            await worker.shutdown()

    asyncio.run(run())


def test_a_node_copy_that_never_comes_fails_the_instance_with_the_reason(thaw_dir):
    async def run():
        streams = WeightStreams("gone", "acme/tiny")
        ticket = streams.open(thaw_dir, 1, StreamConfig(timeout_s=1.0, chunk_bytes=16384))
        streams.close()
        fed = InstanceWorker("fed", "acme/tiny", None, {**ENGINE_CONFIG, "layer_timeout_s": 6.0}, peer=ticket)
        await fed.ready()
        assert await wait_for(lambda: fed.state is InstanceState.FAILED)
        assert "did not arrive within" in fed.stats().weights_read
        await fed.shutdown()

    asyncio.run(run())


def test_bad_tickets_and_fallbacks_are_refused_with_the_reason(thaw_dir, tmp_path):
    async def run():
        source = InstanceWorker("src", "acme/tiny", thaw_dir, ENGINE_CONFIG)
        await source.ready()
        ticket = await source.stream_weights(1, StreamConfig(timeout_s=2.0))
        with pytest.raises(ValueError, match="carries 'acme/tiny', not 'acme/other'"):
            InstanceWorker("x", "acme/other", None, ENGINE_CONFIG, peer=ticket)
        with pytest.raises(ValueError, match="needs a model_dir, or a peer"):
            InstanceWorker("x", "acme/tiny", None, ENGINE_CONFIG)
        with pytest.raises(ValueError, match="no stream to fall back from"):
            source.supply_fallback(str(thaw_dir))
        for bad in (0, True, 1.5):
            with pytest.raises(ValueError, match="num_receivers must be an integer >= 1"):
                await source.stream_weights(bad, STREAM)
        fed = InstanceWorker("fed", "acme/tiny", None, ENGINE_CONFIG, peer=ticket)
        with pytest.raises(ValueError, match="not a thaw checkpoint"):
            fed.supply_fallback(str(tmp_path))
        await fed.ready()
        assert await wait_for(lambda: fed.stats().weights_resident)
        for worker in (fed, source):
            await worker.shutdown()

    asyncio.run(run())
