"""Scale-out by streaming, end to end in the engine: a peer process streams a real checkpoint to
an engine that serves while the layers arrive; when the peer is killed mid-stream, the engine
falls back to the tier loader and its greedy output still equals a normally loaded engine's."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from loader import FallbackLayers, LayerStreamReceiver, StreamConfig, ThawCheckpointLoader, convert_checkpoint
from tests.loader.stream_peers import run_checkpoint_source
from worker.engine.engine import Engine
from worker.engine.engine_config import EngineConfig
from wire.sampling_params import SamplingParams

WAIT_S = 30  # a guard so a bug fails the test instead of hanging it
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPTS = ["the cat sat on the", "a dog ran"]


@pytest.fixture(scope="module")
def thaw_dir(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("stream-fallback") / "thaw"
    convert_checkpoint(tiny_llama_dir, out, progress=False)
    return out


def _expect(conn, kind: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if conn.poll(max(0.0, deadline - time.monotonic())):
            event = conn.recv()
            if event[0] == kind:
                return event
    raise AssertionError(f"no {kind!r} event from the peer within {WAIT_S} s")


def _run(engine: Engine) -> list[list[int]]:
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    deadline = time.monotonic() + WAIT_S
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish"
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return [outputs[rid] for rid in ids]


@pytest.mark.parametrize("kill", [False, True])
def test_an_engine_fed_by_a_peer_serves_exactly_and_falls_back_when_the_peer_dies(thaw_dir, kill):
    want = _run(Engine(thaw_dir, EngineConfig()))
    ctx = multiprocessing.get_context("spawn")
    events, events_out = ctx.Pipe(duplex=False)
    wait_end, release = ctx.Pipe(duplex=False)
    config = StreamConfig(timeout_s=10, chunk_bytes=16384)
    peer = ctx.Process(target=run_checkpoint_source, args=(events_out, wait_end, str(thaw_dir), config, 0), daemon=True)
    peer.start()
    try:
        rendezvous = _expect(events, "rendezvous")[1]
        receiver = LayerStreamReceiver(rendezvous, 1, config)
        receiver.start()
        tier_loads = []

        def open_tier():
            loader = ThawCheckpointLoader(thaw_dir)
            tier_loads.append(loader)
            return loader

        layers = FallbackLayers(receiver, open_tier)
        engine = Engine(thaw_dir, EngineConfig(), weights=layers)
        _expect(events, "sent")  # layer -1 sent
        _expect(events, "sent")  # layer 0 sent: the peer now holds
        receiver.wait_layer(0, WAIT_S)
        if kill:
            peer.kill()
        else:
            release.send(b"go")
        got = _run(engine)
        assert got == want
        assert layers.switched is kill and len(tier_loads) == int(kill)
        if kill:
            assert "failed at layer" in layers.reason
        assert engine.weights_resident
        receiver.close()  # (the tier loader is left open: the engine's weights are views of its buffer)
    finally:
        if peer.is_alive():
            peer.kill()
        peer.join(WAIT_S)
