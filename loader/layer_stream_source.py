"""The sending end of a layer stream: a process that holds a model's tensors (rank 0).

`LayerStreamSource` lays the tensors out (`StreamPlan`), opens the stream's rendezvous store (the
one place receivers connect to first; each link then gets its own private process group through
it), and on `start()` sends the plan and every chunk, in layer order, to rank 1 -- and only to
rank 1: the receivers forward down the chain themselves.

It never copies the model: a chunk that lies inside one tensor is sent straight from that
tensor's memory; only chunks that straddle several small tensors (norms, biases) are packed into a
chunk-sized staging tensor first. Up to `max_inflight_chunks` sends are in flight at once so the
transport never waits on Python.
"""

from __future__ import annotations

import bisect
import datetime
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from loader.layer_stream import StreamConfig, StreamRendezvous, StreamStats
from loader.peer_link import CHUNK_TAG_BASE, PeerLink
from loader.stream_plan import StreamChunk, StreamPlan


class _SourceBytes:
    """The source tensors as byte ranges of the plan's flat layout, sliced into chunks on demand."""

    def __init__(self, plan: StreamPlan, tensors: Mapping[str, torch.Tensor]):
        self._starts: list[int] = []
        self._bytes: list[torch.Tensor] = []  # each [size] uint8, a view of (a contiguous copy of) a tensor
        for t in plan.tensors:
            if t.size == 0:
                continue
            tensor = tensors[t.name].detach().contiguous()
            self._starts.append(t.offset)
            self._bytes.append(tensor.reshape(-1).view(torch.uint8))

    def chunk(self, chunk: StreamChunk) -> torch.Tensor:
        """[chunk.size] uint8: a view when one tensor covers the chunk, else a packed copy."""
        start, end = chunk.offset, chunk.offset + chunk.size
        i = bisect.bisect_right(self._starts, start) - 1
        first = self._bytes[i] if i >= 0 else None
        if first is not None and self._starts[i] + first.numel() >= end:
            return first[start - self._starts[i]: end - self._starts[i]]
        packed = torch.zeros(chunk.size, dtype=torch.uint8, device=self._bytes[0].device)  # padding stays 0
        for j in range(max(i, 0), len(self._starts)):
            t_start, t_bytes = self._starts[j], self._bytes[j]
            if t_start >= end:
                break
            lo, hi = max(start, t_start), min(end, t_start + t_bytes.numel())
            if lo < hi:
                packed[lo - start: hi - start] = t_bytes[lo - t_start: hi - t_start]
        return packed


class LayerStreamSource:
    """Streams `tensors` to `num_receivers` chained receivers; see the module docstring.

    Usage::

        source = LayerStreamSource(worker_weights, num_receivers=3, config=StreamConfig())
        ticket = source.rendezvous              # hand to every receiver with its rank (1..3)
        source.start()                          # returns at once; the stream runs on a thread
        stats = source.wait()                   # after rank 1 has acknowledged every chunk
        source.close()

    The tensors must stay alive and unmodified until `wait()` returns; they must live on the
    backend's device (CPU for gloo). `on_layer_sent(layer)` is called on the stream's thread after
    each layer has been handed to the transport (progress reporting; it must not block for long).
    The rendezvous store lives as long as the source: `wait()` keeps it up until every receiver has
    connected (at most `timeout_s` past the end of the stream), so late links can still form.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], num_receivers: int, config: StreamConfig | None = None,
                 *, num_layers: int | None = None, on_layer_sent: Callable[[int], None] | None = None):
        self.config = config or StreamConfig()
        if not isinstance(num_receivers, int) or isinstance(num_receivers, bool) or num_receivers < 1:
            raise ValueError(f"num_receivers is {num_receivers!r}; a stream needs at least 1 receiver")
        wanted = "cpu" if self.config.backend == "gloo" else "cuda"
        for name, tensor in tensors.items():
            if tensor.device.type != wanted:
                raise ValueError(f"tensor {name!r} is on {tensor.device}; backend {self.config.backend!r} "
                                 f"sends {wanted} tensors")
        self.plan = StreamPlan.from_tensors(tensors, transfer_id=uuid.uuid4().hex,
                                            chunk_bytes=self.config.chunk_bytes, num_layers=num_layers)
        self._bytes = _SourceBytes(self.plan, tensors)
        self._device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        self._on_layer_sent = on_layer_sent
        self._store = dist.TCPStore(self.config.host, self.config.port, is_master=True, wait_for_workers=False,
                                    timeout=_seconds(self.config.timeout_s))
        self.rendezvous = StreamRendezvous(host=self.config.host, port=self._store.port,
                                           transfer_id=self.plan.transfer_id, num_receivers=num_receivers)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._num_bytes_sent = 0
        self._connect_s = self._elapsed_s = 0.0
        self._start_time = 0.0
        self._num_layers_reported = 0
        self._closing = False

    def start(self) -> None:
        """Start streaming on a background thread (idempotent)."""
        with self._lock:
            if self._thread is not None:
                return
            if self._store is None:
                raise RuntimeError("LayerStreamSource.start() after close()")
            self._thread = threading.Thread(target=self._run, name="thaw-stream-source", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        link = None
        try:
            t0 = time.perf_counter()
            link = PeerLink(self._store, transfer_id=self.plan.transfer_id, rank=0, peer_rank=1,
                            backend=self.config.backend, timeout_s=self.config.timeout_s, device=self._device)
            self._connect_s = time.perf_counter() - t0
            self._start_time = time.perf_counter()
            link.send_plan(self.plan.to_bytes())
            in_flight: deque[tuple[dist.Work, torch.Tensor, int]] = deque()  # (work, bytes kept alive, layer)
            num_sent = 0
            self._report_layers(num_sent)
            for i, chunk in enumerate(self.plan.chunks):
                if self._closing:
                    raise RuntimeError(f"the source was closed while sending layer {chunk.layer}")
                payload = self._bytes.chunk(chunk)
                in_flight.append((link.send(payload, CHUNK_TAG_BASE + i, layer=chunk.layer), payload, chunk.layer))
                while in_flight and (len(in_flight) >= self.config.max_inflight_chunks
                                     or i == len(self.plan.chunks) - 1):
                    work, payload, layer = in_flight.popleft()
                    link.wait(work, "sending", layer=layer)
                    num_sent += 1
                    with self._lock:
                        self._num_bytes_sent += payload.numel()
                    self._report_layers(num_sent)
            link.recv_ack(len(self.plan.chunks), layer=self.plan.num_layers)
            self._elapsed_s = time.perf_counter() - self._start_time
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc
        finally:
            if link is not None:
                link.close()  # the connection to rank 1

    def _report_layers(self, num_chunks_sent: int) -> None:
        """Call on_layer_sent for every layer whose chunks have all been sent (empty layers too)."""
        while self._num_layers_reported < len(self.plan.layers):
            layer = self.plan.layers[self._num_layers_reported]
            if self.plan.layer_chunk_end[layer] > num_chunks_sent:
                return
            self._num_layers_reported += 1
            if self._on_layer_sent is not None:
                self._on_layer_sent(layer)

    def wait(self, timeout_s: float | None = None) -> StreamStats:
        """Block until rank 1 has acknowledged every chunk; raises PeerStreamError if it died,
        stalled or never connected, TimeoutError after `timeout_s`."""
        self.start()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"stream {self.plan.transfer_id} to rank 1 not finished after {timeout_s} s "
                               f"({self._num_bytes_sent} of {self.plan.total_bytes} bytes sent)")
        if self._error is not None:
            raise self._error
        self._wait_for_receivers()
        return self.stats

    def _wait_for_receivers(self) -> None:
        """Keep the store up until every receiver has built its upstream link (best effort: a
        receiver that never comes up is its upstream neighbour's problem, not the source's)."""
        keys = [f"thaw-stream/{self.plan.transfer_id}/connected/{r}"
                for r in range(1, self.rendezvous.num_receivers + 1)]
        with self._lock:
            store = self._store
        if store is None:
            return
        try:
            store.wait(keys, _seconds(self.config.timeout_s))
        except RuntimeError:
            pass

    @property
    def stats(self) -> StreamStats:
        with self._lock:
            num_bytes = self._num_bytes_sent
        elapsed = self._elapsed_s or (time.perf_counter() - self._start_time if self._start_time else 0.0)
        return StreamStats(rank=0, num_bytes=num_bytes, total_bytes=self.plan.total_bytes, elapsed_s=elapsed,
                           connect_s=self._connect_s, num_forwarded_bytes=num_bytes)

    def close(self) -> None:
        """Stop a stream still running (at the next chunk; rank 1 then sees PeerStreamError) and
        drop the rendezvous store. After `wait()` this only drops the store."""
        self._closing = True
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()  # the current step ends within timeout_s
        with self._lock:
            self._store = None

    def __enter__(self) -> LayerStreamSource:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _seconds(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s)
