"""Layer streaming from a peer: bit-exact copies, chain multicast, per-layer readiness, dead peers.

Every source and every receiver but the one under test runs in its own spawned process (a real
gloo link over loopback, as between two workers); the receiver under test runs in the test
process so its `LayerReadiness` interface is exercised directly. Holding the source after a layer
(its `on_layer_sent` hook waits on an event) makes "mid-stream" deterministic: no sleeps.
"""

import multiprocessing
import socket
import time
from multiprocessing.connection import Connection, wait

import pytest
import torch

from loader import (LayerReadiness, LayerStreamReceiver, LayerStreamSource, PeerStreamError, StreamConfig,
                    StreamRendezvous, ThawCheckpointLoader)
from tests.loader.stream_peers import NUM_LAYERS, model_tensors, run_receiver, run_source, tensor_digest

WAIT_S = 30  # a guard so a bug fails the test instead of hanging it; never reached when correct


class _Peers:
    """Spawned source and receiver processes, each with an events pipe and a release pipe."""

    def __init__(self):
        self._ctx = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.Process] = []
        self._events: list[Connection] = []  # the receiving end of each process's events pipe
        self._release_pipes = {}  # process -> the sending end of its release pipe
        self._backlog: list[tuple] = []

    def _spawn(self, target, *args) -> multiprocessing.Process:
        events_in, events_out = self._ctx.Pipe(duplex=False)
        wait_end, release_end = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(target=target, args=(events_out, wait_end, *args), daemon=True)
        process.start()
        events_out.close()  # the child holds its copy: EOF here once it exits
        self.processes.append(process)
        self._events.append(events_in)
        self._release_pipes[process] = release_end
        return process

    def release(self, process) -> None:
        """Let a process held after a layer go on."""
        self._release_pipes[process].send(b"go")

    def start_source(self, num_receivers, config, *, dtype=torch.bfloat16, big_rows=97, hold_after_layer=None):
        process = self._spawn(run_source, num_receivers, config, dtype, big_rows, hold_after_layer)
        return process, self.wait_event(lambda e: e[0] == "rendezvous")[1]

    def start_receiver(self, rendezvous, rank, config, *, hold_after_layer=None):
        return self._spawn(run_receiver, rendezvous, rank, config, hold_after_layer)

    def wait_event(self, match, timeout_s=WAIT_S) -> tuple:
        """The first event (in arrival order) that `match`es; others are kept for later calls."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i, event in enumerate(self._backlog):
                if match(event):
                    return self._backlog.pop(i)
            open_pipes = [c for c in self._events if not c.closed]
            ready = wait(open_pipes, timeout=max(0.0, deadline - time.monotonic())) if open_pipes else []
            if not ready and time.monotonic() >= deadline:
                raise AssertionError(f"no matching event within {timeout_s} s; seen: {self._backlog}")
            for pipe in ready:
                try:
                    self._backlog.append(pipe.recv())
                except EOFError:  # that process has exited
                    pipe.close()

    def close(self):
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(WAIT_S)


@pytest.fixture
def peers():
    p = _Peers()
    yield p
    p.close()


def _digests(tensors):
    return {name: tensor_digest(t) for name, t in tensors.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_streamed_tensors_are_bit_identical(peers, dtype):
    config = StreamConfig(timeout_s=10, chunk_bytes=4096)  # small chunks: many per layer, some packed
    _, rendezvous = peers.start_source(1, config, dtype=dtype)
    expected = model_tensors(dtype)
    with LayerStreamReceiver(rendezvous, 1, config) as receiver:
        got = receiver.wait_all(WAIT_S)
        plan = receiver.wait_plan()
        assert list(got) == [t.name for t in plan.tensors]  # layer order
        assert _digests(got) == _digests(expected)
        assert receiver.num_layers == NUM_LAYERS
        assert all(receiver.layer_ready(k) for k in range(-1, NUM_LAYERS + 1))
        del got
        stats = receiver.stats
    assert len(plan.chunks) > 2 * (NUM_LAYERS + 2)
    assert stats.num_bytes == sum(c.size for c in plan.chunks) and stats.total_bytes == plan.total_bytes
    assert stats.num_forwarded_bytes == 0 and stats.forward_error is None and stats.gb_per_s > 0
    source_done = peers.wait_event(lambda e: e[0].startswith("source_"))
    assert source_done[0] == "source_done", source_done
    assert source_done[1].num_bytes == stats.num_bytes


def test_chain_multicast_to_three_receivers(peers):
    config = StreamConfig(timeout_s=10, chunk_bytes=8192)
    _, rendezvous = peers.start_source(3, config, big_rows=301)
    for rank in (1, 2):
        peers.start_receiver(rendezvous, rank, config)
    expected = _digests(model_tensors(torch.bfloat16, big_rows=301))
    with LayerStreamReceiver(rendezvous, 3, config) as last:
        assert _digests(last.wait_all(WAIT_S)) == expected
        last_stats = last.wait_forwarded(WAIT_S)
    assert last_stats.num_forwarded_bytes == 0 and last_stats.forward_error is None
    for rank in (1, 2):
        event = peers.wait_event(lambda e, rank=rank: e[0] in ("received", "receiver_error") and e[1] == rank)
        assert event[0] == "received", event
        _, _, digests, stats = event
        assert digests == expected
        assert stats.forward_error is None and stats.num_forwarded_bytes == stats.num_bytes == last_stats.num_bytes
    source_done = peers.wait_event(lambda e: e[0].startswith("source_"))
    assert source_done[0] == "source_done", source_done
    assert source_done[1].num_bytes == last_stats.num_bytes  # the source sent the model once, to rank 1 only


def test_layers_become_ready_in_order(peers):
    config = StreamConfig(timeout_s=10, chunk_bytes=4096)
    source, rendezvous = peers.start_source(1, config, hold_after_layer=0)
    expected = model_tensors(torch.bfloat16)
    with LayerStreamReceiver(rendezvous, 1, config) as receiver:
        assert isinstance(receiver, LayerReadiness)
        layer0 = receiver.wait_layer(0, WAIT_S)
        assert sorted(layer0) == sorted(n for n in expected if n.startswith("model.layers.0."))
        assert _digests(layer0) == _digests({n: expected[n] for n in layer0})
        assert receiver.layer_ready(-1) and receiver.layer_ready(0)
        assert not any(receiver.layer_ready(k) for k in range(1, NUM_LAYERS + 1))  # the source holds after 0
        with pytest.raises(TimeoutError, match=f"layer {NUM_LAYERS} not received by rank 1"):
            receiver.wait_layer(NUM_LAYERS, timeout_s=0.2)
        peers.release(source)
        final = receiver.wait_layer(NUM_LAYERS, WAIT_S)
        assert sorted(final) == ["lm_head.weight", "model.norm.weight"]
        assert all(receiver.layer_ready(k) for k in range(-1, NUM_LAYERS + 1))
        with pytest.raises(ValueError, match="layer 7 does not exist"):
            receiver.layer_ready(7)
        del layer0, final
    assert [peers.wait_event(lambda e: e[0] == "sent")[1] for _ in range(NUM_LAYERS + 2)] == \
        list(range(-1, NUM_LAYERS + 1))


def test_killed_source_raises_peer_stream_error_in_time(peers):
    config = StreamConfig(timeout_s=5, chunk_bytes=4096)
    source, rendezvous = peers.start_source(1, config, hold_after_layer=0)
    with LayerStreamReceiver(rendezvous, 1, config) as receiver:
        receiver.wait_layer(0, WAIT_S)
        source.kill()
        start = time.monotonic()
        with pytest.raises(PeerStreamError, match="upstream peer rank 0 at layer 1") as info:
            receiver.wait_all(WAIT_S)
        assert time.monotonic() - start < config.timeout_s
        assert (info.value.peer_rank, info.value.layer) == (0, 1)
        assert not receiver.layer_ready(0)  # nothing is handed out from a failed stream
        with pytest.raises(PeerStreamError) as again:
            receiver.wait_layer(0)
        assert again.value is info.value


def test_stalled_source_raises_peer_stream_error_after_timeout(peers):
    config = StreamConfig(timeout_s=1.5, chunk_bytes=4096)
    _, rendezvous = peers.start_source(1, config, hold_after_layer=0)
    with LayerStreamReceiver(rendezvous, 1, config) as receiver:
        receiver.wait_layer(0, WAIT_S)
        start = time.monotonic()
        with pytest.raises(PeerStreamError, match="peer rank 0 at layer 1") as info:
            receiver.wait_all(WAIT_S)
        assert time.monotonic() - start < config.timeout_s + 5
        assert "stalled" in str(info.value)


def test_dead_downstream_receiver_does_not_stop_upstream(peers):
    config = StreamConfig(timeout_s=10, chunk_bytes=4096)  # room for rank 2's process to start while the source holds
    source, rendezvous = peers.start_source(2, config, hold_after_layer=0)
    downstream = peers.start_receiver(rendezvous, 2, config, hold_after_layer=0)
    expected = _digests(model_tensors(torch.bfloat16))
    with LayerStreamReceiver(rendezvous, 1, config) as receiver:
        receiver.wait_layer(0, WAIT_S)
        peers.wait_event(lambda e: e == ("layer", 2, 0))  # rank 2 is mid-stream too
        downstream.kill()
        downstream.join(WAIT_S)
        peers.release(source)
        assert _digests(receiver.wait_all(WAIT_S)) == expected
        stats = receiver.wait_forwarded(WAIT_S)
        plan = receiver.wait_plan()
    assert stats.forward_error is not None and "peer rank 2" in stats.forward_error
    assert stats.num_bytes == sum(c.size for c in plan.chunks)
    source_done = peers.wait_event(lambda e: e[0].startswith("source_"))
    assert source_done[0] == "source_done", source_done


def test_unreachable_source_raises_peer_stream_error():
    with socket.socket() as s:  # a port nothing listens on: bind one, then let it go
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = StreamConfig(timeout_s=1)
    with LayerStreamReceiver(StreamRendezvous("127.0.0.1", port, "missing", 1), 1, config) as receiver:
        start = time.monotonic()
        with pytest.raises(PeerStreamError, match="rendezvous store") as info:
            receiver.wait_layer(0, WAIT_S)
        assert time.monotonic() - start < config.timeout_s + 5
        assert info.value.peer_rank == 0 and info.value.layer is None


def test_checkpoint_loader_satisfies_layer_readiness():
    assert issubclass(ThawCheckpointLoader, LayerReadiness)
    assert issubclass(LayerStreamReceiver, LayerReadiness)


@pytest.mark.parametrize("field, value, message", [
    ("timeout_s", 0, "timeout_s"), ("timeout_s", float("inf"), "timeout_s"), ("timeout_s", True, "timeout_s"),
    ("chunk_bytes", 1000, "multiple of 4096"), ("chunk_bytes", 0, "chunk_bytes"), ("chunk_bytes", 1 << 32, "chunk"),
    ("backend", "mpi", "backend"), ("host", "", "host"), ("port", 70000, "port"), ("port", -1, "port"),
    ("max_inflight_chunks", 0, "max_inflight_chunks"),
])
def test_stream_config_rejects_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        StreamConfig(**{field: value})


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="port"):
        StreamRendezvous("127.0.0.1", 0, "t", 1)
    with pytest.raises(ValueError, match="num_receivers"):
        StreamRendezvous("127.0.0.1", 1234, "t", 0)
    rendezvous = StreamRendezvous("127.0.0.1", 1234, "t", 2)
    for rank in (0, 3):
        with pytest.raises(ValueError, match=r"ranks 1\.\.2"):
            LayerStreamReceiver(rendezvous, rank)
    with pytest.raises(ValueError, match="at least 1 receiver"):
        LayerStreamSource({"model.embed_tokens.weight": torch.zeros(2)}, 0)
    with pytest.raises(ValueError, match="complex64"):
        LayerStreamSource({"model.embed_tokens.weight": torch.zeros(2, dtype=torch.complex64)}, 1)
    with pytest.raises(ValueError, match="num_layers is 1 but tensors name decoder layer 2"):
        LayerStreamSource({"model.layers.2.w": torch.zeros(2)}, 1, num_layers=1)
