"""Streaming a model's weights from a running peer, layer by layer: the shared vocabulary.

The second way for a new instance to get its weights, after the SSD/DRAM loader: copy them from
an instance that already holds them (BlitzScale, OSDI'25). The source (`LayerStreamSource`,
rank 0) sends a plan (`StreamPlan`) and then every layer in order -1, 0..N-1, N, as a few large
chunks per layer, over ``torch.distributed`` point-to-point (gloo on CPU, NCCL on GPUs: the same
code, `StreamConfig.backend`). Receivers (`LayerStreamReceiver`, ranks 1..k) form a chain: the
source sends to rank 1 only, and rank i forwards each chunk to rank i+1 as soon as it has landed,
while it receives the next -- so k receivers take about as long as one, not k times as long (chain
multicast), and no link carries the model more than once. Each receiver hands out layers through
the same `LayerReadiness` interface as the SSD loader.

This file holds what both ends share: the configuration (`StreamConfig`), the ticket a receiver
needs to join a stream (`StreamRendezvous`, a small message the controller hands out) and the
per-rank report (`StreamStats`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loader.peer_link import BACKENDS

DEFAULT_CHUNK_BYTES = 16 << 20  # loopback gloo, 2 cores: 4 MiB 1.1 GB/s, 16 MiB 2.4-2.5 GB/s, 64 MiB 2.1 GB/s
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 1 << 31  # gloo counts message bytes in a signed 32-bit int on some paths


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class StreamConfig:
    """How to run a stream. Receivers take `chunk_bytes` from the source's plan, not from here."""

    # Longest wait for any one step to make progress (a peer connecting, a chunk landing, an ack):
    # a dead or stalled peer is reported as PeerStreamError after at most this long.
    timeout_s: float = 30.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # one message; a chunk never spans two layers
    backend: str = "gloo"  # "gloo" (CPU tensors) or "nccl" (CUDA tensors)
    host: str = "127.0.0.1"  # the address receivers reach the source's rendezvous store at
    port: int = 0  # the source's rendezvous store port; 0 picks a free one (see StreamRendezvous.port)
    max_inflight_chunks: int = 2  # per link: chunks posted before the oldest is waited on

    def __post_init__(self) -> None:
        timeout_ok = isinstance(self.timeout_s, (int, float)) and not isinstance(self.timeout_s, bool)
        if not timeout_ok or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"StreamConfig.timeout_s is {self.timeout_s!r}; use a finite number of seconds > 0 "
                             f"(e.g. 30)")
        if not _is_int(self.chunk_bytes) or not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES \
                or self.chunk_bytes % MIN_CHUNK_BYTES:
            raise ValueError(f"StreamConfig.chunk_bytes is {self.chunk_bytes!r}; use a multiple of {MIN_CHUNK_BYTES} "
                             f"in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES} (default {DEFAULT_CHUNK_BYTES})")
        if self.backend not in BACKENDS:
            raise ValueError(f"StreamConfig.backend is {self.backend!r}; use one of {', '.join(BACKENDS)} "
                             f"('gloo' for CPU tensors, 'nccl' for CUDA tensors)")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"StreamConfig.host is {self.host!r}; use the source's address, e.g. '127.0.0.1'")
        if not _is_int(self.port) or not 0 <= self.port <= 65535:
            raise ValueError(f"StreamConfig.port is {self.port!r}; use 0 (pick a free port) or a port in 1..65535")
        if not _is_int(self.max_inflight_chunks) or not 1 <= self.max_inflight_chunks <= 64:
            raise ValueError(f"StreamConfig.max_inflight_chunks is {self.max_inflight_chunks!r}; use an integer "
                             f"in 1..64 (default 2)")


@dataclass(frozen=True)
class StreamRendezvous:
    """What a receiver needs to join a stream: the source's store address, the stream's id and the
    chain length. The source creates it (`LayerStreamSource.rendezvous`); pass it to every receiver."""

    host: str
    port: int
    transfer_id: str
    num_receivers: int

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"StreamRendezvous.host is {self.host!r}; use the source's address")
        if not _is_int(self.port) or not 1 <= self.port <= 65535:
            raise ValueError(f"StreamRendezvous.port is {self.port!r}; use the port the source's store listens on")
        if not isinstance(self.transfer_id, str) or not self.transfer_id:
            raise ValueError("StreamRendezvous.transfer_id is empty; take the rendezvous from the source")
        if not _is_int(self.num_receivers) or self.num_receivers < 1:
            raise ValueError(f"StreamRendezvous.num_receivers is {self.num_receivers!r}; a stream needs >= 1 receiver")


@dataclass(frozen=True)
class StreamStats:
    """What one rank of a stream did. `elapsed_s` runs from the plan (sent or received) to the last
    chunk (the source: to rank 1's acknowledgement), so it excludes `connect_s`."""

    rank: int  # 0 the source, 1..k the receivers in chain order
    num_bytes: int  # receivers: bytes received so far; the source: bytes sent
    total_bytes: int  # the plan's flat buffer, alignment padding included
    elapsed_s: float
    connect_s: float  # building the link to the upstream peer (the source: to rank 1)
    num_forwarded_bytes: int  # bytes sent on to the next rank (the source: == num_bytes)
    forward_error: str | None = None  # why forwarding to the next rank stopped; None if it did not

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0
