"""The receiving end of a layer stream: one new instance in the chain (ranks 1..k).

`LayerStreamReceiver` runs two threads. The *receive* thread connects to its upstream neighbour
(rank - 1), takes the plan, allocates one flat buffer for the whole model and receives every chunk
into its place there, in layer order; as soon as the last chunk of layer k lands, `wait_layer(k)`
returns views into the buffer -- the same `LayerReadiness` interface as the SSD loader, so the
worker does not care which path delivered its weights. The *forward* thread (all but the last
rank) connects to the downstream neighbour (rank + 1) and sends on each chunk straight from the
buffer right after it landed, while the receive thread takes the next one: the chain multicast is
pipelined per chunk, so k receivers finish about one chunk-time per hop after a single one would.

Failures are kept apart by direction. Anything wrong upstream (the peer died, stalled for
`timeout_s`, never connected, sent a bad plan) fails the receiver: every current and later wait
raises that `PeerStreamError`, and the caller falls back to the tier loader. Anything wrong
downstream only stops the forwarding (reported in `stats.forward_error`): this receiver's own copy
completes regardless.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from loader.layer_stream import StreamConfig, StreamRendezvous, StreamStats
from loader.memory_pool import HostMemoryPool
from loader.peer_link import CHUNK_TAG_BASE, PeerLink, PeerStreamError, connect_store
from loader.stream_plan import StreamPlan


class LayerStreamReceiver:
    """Rank `rank` (1..rendezvous.num_receivers) of the stream `rendezvous`; see the module docstring.

    Usage::

        with LayerStreamReceiver(ticket, rank=1, config=StreamConfig(timeout_s=10)) as receiver:
            receiver.start()                      # optional: every wait starts it too
            embed = receiver.wait_layer(-1)       # {name: view}; PeerStreamError if the peer failed
            ...
            weights = receiver.wait_all()
            receiver.wait_forwarded()             # optional: block until rank + 1 has it all

    The tensors are views into the receiver's buffer: drop (or copy to the device) every one before
    `close()`, which returns the buffer to `pool` when one was given. `close()` after a complete
    stream first lets the forwarding to the next rank finish; before that, it stops both right
    away (at the next chunk boundary). `device` is where the buffer lives ("cpu" for gloo).
    """

    def __init__(self, rendezvous: StreamRendezvous, rank: int, config: StreamConfig | None = None, *,
                 device: torch.device | str = "cpu", pool: HostMemoryPool | None = None):
        self.config = config or StreamConfig()
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= rendezvous.num_receivers:
            raise ValueError(f"rank is {rank!r}; receivers of this stream are ranks 1..{rendezvous.num_receivers} "
                             f"(0 is the source)")
        self.device = torch.device(device)
        if pool is not None and self.device.type != "cpu":
            raise ValueError(f"a HostMemoryPool holds CPU memory; drop `pool` for device {self.device}")
        self.rendezvous = rendezvous
        self.rank = rank
        self._pool = pool
        self._cond = threading.Condition()
        self._plan: StreamPlan | None = None
        self._plan_bytes = b""
        self._buffer: torch.Tensor | None = None  # [plan.total_bytes] uint8
        self._num_chunks_landed = 0
        self._num_bytes_landed = 0
        self._error: BaseException | None = None
        self._receive_done = False
        self._forward_done = rank == rendezvous.num_receivers  # the last rank forwards nothing
        self._forward_error: str | None = None
        self._num_bytes_forwarded = 0
        self._started = self._closing = self._closed = False
        self._threads: list[threading.Thread] = []
        self._connect_s = self._start_time = self._end_time = 0.0

    # -- the two threads ------------------------------------------------------------------------

    def start(self) -> None:
        """Connect and start receiving (and forwarding) in the background (idempotent)."""
        with self._cond:
            if self._closed or self._closing:
                raise RuntimeError("LayerStreamReceiver.start() after close()")
            if self._started:
                return
            self._started = True
            self._threads.append(threading.Thread(target=self._receive, name=f"thaw-stream-recv-{self.rank}",
                                                  daemon=True))
            if not self._forward_done:
                self._threads.append(threading.Thread(target=self._forward, name=f"thaw-stream-fwd-{self.rank}",
                                                      daemon=True))
        for thread in self._threads:
            thread.start()

    def _connect(self, peer_rank: int) -> PeerLink:
        r = self.rendezvous
        store = connect_store(r.host, r.port, self.config.timeout_s, rank=self.rank, peer_rank=peer_rank)
        link = PeerLink(store, transfer_id=r.transfer_id, rank=self.rank, peer_rank=peer_rank,
                        backend=self.config.backend, timeout_s=self.config.timeout_s, device=self.device)
        if peer_rank < self.rank:  # tells the source its store may go once every link has formed
            try:
                store.set(f"thaw-stream/{r.transfer_id}/connected/{self.rank}", "1")
            except RuntimeError:
                pass  # the source (and its store) may already be gone; the link itself is up
        return link

    def _receive(self) -> None:
        link, layer = None, None
        try:
            t0 = time.perf_counter()
            link = self._connect(self.rank - 1)
            self._connect_s = time.perf_counter() - t0
            plan_bytes = link.recv_plan()
            self._start_time = time.perf_counter()
            try:
                plan = StreamPlan.from_bytes(plan_bytes)
            except ValueError as exc:
                raise PeerStreamError(f"rank {self.rank}: upstream peer rank {self.rank - 1} sent an unreadable "
                                      f"plan: {exc}", peer_rank=self.rank - 1, layer=None) from None
            if plan.transfer_id != self.rendezvous.transfer_id:
                raise PeerStreamError(f"rank {self.rank}: upstream peer rank {self.rank - 1} streams "
                                      f"{plan.transfer_id}, expected {self.rendezvous.transfer_id}",
                                      peer_rank=self.rank - 1, layer=None)
            if self._pool is not None:
                buffer = self._pool.acquire(plan.total_bytes)
            else:
                buffer = torch.empty(plan.total_bytes, dtype=torch.uint8, device=self.device)
            with self._cond:
                self._plan, self._plan_bytes, self._buffer = plan, plan_bytes, buffer
                self._cond.notify_all()
            in_flight: deque[tuple[dist.Work, int]] = deque()  # (work, chunk index)
            last = len(plan.chunks) - 1
            for i, chunk in enumerate(plan.chunks):
                if self._closing:
                    raise RuntimeError(f"the receiver was closed while receiving layer {chunk.layer}")
                layer = chunk.layer
                target = buffer[chunk.offset: chunk.offset + chunk.size]  # [size] uint8
                in_flight.append((link.recv(target, CHUNK_TAG_BASE + i, layer=layer), i))
                while in_flight and (len(in_flight) >= self.config.max_inflight_chunks or i == last):
                    work, done = in_flight.popleft()
                    layer = plan.chunks[done].layer
                    link.wait(work, "receiving", layer=layer)
                    with self._cond:
                        self._num_chunks_landed += 1
                        self._num_bytes_landed += plan.chunks[done].size
                        self._cond.notify_all()
            with self._cond:
                self._end_time = time.perf_counter()
                self._receive_done = True
                self._cond.notify_all()
            try:
                link.send_ack(len(plan.chunks))
            except PeerStreamError:
                pass  # every byte is in: an upstream that has gone since is no longer our problem
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            with self._cond:
                if self._error is None:
                    self._error = exc
                self._cond.notify_all()
        finally:
            if link is not None:
                link.close()

    def _forward(self) -> None:
        link = None
        try:
            link = self._connect(self.rank + 1)
            with self._cond:
                self._cond.wait_for(lambda: self._plan is not None or self._error is not None or self._closing)
                if self._plan is None:
                    return  # upstream failed: dropping the link tells the next rank at once
                plan, plan_bytes, buffer = self._plan, self._plan_bytes, self._buffer
            link.send_plan(plan_bytes)
            in_flight: deque[tuple[dist.Work, int]] = deque()
            last = len(plan.chunks) - 1
            for i, chunk in enumerate(plan.chunks):
                with self._cond:
                    self._cond.wait_for(lambda: self._num_chunks_landed > i or self._error is not None
                                        or (self._closing and not self._receive_done))
                    if self._num_chunks_landed <= i:
                        return
                source = buffer[chunk.offset: chunk.offset + chunk.size]
                in_flight.append((link.send(source, CHUNK_TAG_BASE + i, layer=chunk.layer), i))
                while in_flight and (len(in_flight) >= self.config.max_inflight_chunks or i == last):
                    work, done = in_flight.popleft()
                    link.wait(work, "forwarding", layer=plan.chunks[done].layer)
                    with self._cond:
                        self._num_bytes_forwarded += plan.chunks[done].size
            link.recv_ack(len(plan.chunks), layer=plan.num_layers)
        except BaseException as exc:  # noqa: BLE001 - a downstream failure only stops the forwarding
            with self._cond:
                self._forward_error = f"{type(exc).__name__}: {exc}"
        finally:
            if link is not None:
                link.close()
            with self._cond:
                self._forward_done = True
                self._cond.notify_all()

    # -- LayerReadiness -------------------------------------------------------------------------

    def _wait(self, done, what: str, timeout_s: float | None) -> None:
        self.start()
        with self._cond:
            finished = self._cond.wait_for(
                lambda: self._error is not None or self._closing or (self._plan is not None and done()),
                timeout=timeout_s)
            if self._error is not None:
                raise self._error
            if self._closing:
                raise RuntimeError(f"the receiver was closed while waiting for {what}")
            if not finished:
                total = self._plan.total_bytes if self._plan is not None else "?"
                raise TimeoutError(f"{what} not received by rank {self.rank} from rank {self.rank - 1} after "
                                   f"{timeout_s} s ({self._num_bytes_landed} of {total} bytes in)")

    def _check_layer(self, layer: int) -> None:
        if layer not in self._plan.layers:
            raise ValueError(f"layer {layer} does not exist: layers run from -1 (embedding) to "
                             f"{self._plan.num_layers} (final norm and head)")

    def wait_plan(self, timeout_s: float | None = None) -> StreamPlan:
        """Block until the plan has arrived (names, dtypes, shapes and layer of every tensor)."""
        self._wait(lambda: True, "the stream's plan", timeout_s)
        return self._plan

    @property
    def num_layers(self) -> int:
        """Decoder layers of the streamed model (blocks for the plan, at most `timeout_s`)."""
        return self.wait_plan(self.config.timeout_s).num_layers

    def layer_ready(self, layer: int) -> bool:
        """Whether every chunk of `layer` has landed (False before the plan and after any failure)."""
        with self._cond:
            if self._plan is None or self._error is not None or self._closing:
                return False
            self._check_layer(layer)
            return self._num_chunks_landed >= self._plan.layer_chunk_end[layer]

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """Block until `layer` (-1 embedding, 0..N-1 decoder layers, N final group) has landed; its
        tensors as views into the buffer. PeerStreamError if upstream failed, TimeoutError after
        `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        plan = self.wait_plan(timeout_s)
        self._check_layer(layer)
        left_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._wait(lambda: self._num_chunks_landed >= plan.layer_chunk_end[layer], f"layer {layer}", left_s)
        return {t.name: plan.view(self._buffer, t) for t in plan.tensors_in_layer(layer)}

    def wait_all(self, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """Block until every chunk has landed; all tensors, in layer order."""
        self._wait(lambda: self._receive_done, "every layer", timeout_s)
        return {t.name: self._plan.view(self._buffer, t) for t in self._plan.tensors}

    def wait_forwarded(self, timeout_s: float | None = None) -> StreamStats:
        """Block until forwarding to rank + 1 has finished or given up (see `stats.forward_error`)."""
        self.start()
        with self._cond:
            if not self._cond.wait_for(lambda: self._forward_done, timeout=timeout_s):
                raise TimeoutError(f"rank {self.rank} still forwarding to rank {self.rank + 1} after {timeout_s} s")
        return self.stats

    @property
    def stats(self) -> StreamStats:
        with self._cond:
            end = self._end_time if self._receive_done else time.perf_counter()
            return StreamStats(rank=self.rank, num_bytes=self._num_bytes_landed,
                               total_bytes=self._plan.total_bytes if self._plan is not None else 0,
                               elapsed_s=end - self._start_time if self._start_time else 0.0,
                               connect_s=self._connect_s, num_forwarded_bytes=self._num_bytes_forwarded,
                               forward_error=self._forward_error)

    # -- teardown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish forwarding a complete stream, else stop; then release the buffer (see the class doc)."""
        with self._cond:
            if self._closed:
                return
            if not self._receive_done:
                self._closing = True
            self._cond.notify_all()
        # Each thread's current step is bounded by timeout_s; then it sees _closing or finishes.
        for thread in self._threads:
            thread.join()
        with self._cond:
            self._closing = self._closed = True
            buffer, self._buffer = self._buffer, None
            self._cond.notify_all()
        if buffer is not None and self._pool is not None:
            self._pool.release(buffer)

    def __enter__(self) -> LayerStreamReceiver:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
