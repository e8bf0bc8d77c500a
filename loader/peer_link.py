"""One link of a parameter-stream chain: a private two-rank process group between neighbours.

Why a group per link rather than one group for the whole chain: a gloo (or NCCL) group connects
every pair of its ranks when it is built, so one group would make every receiver wait for every
other one to show up, and would tie the fate of the link (1, 2) to a crash of rank 3. A
two-rank group per link keeps each link independent: a downstream receiver that never arrives or
dies costs only its upstream neighbour's *forwarding*, never that neighbour's own copy. Groups are
built directly on a store (``ProcessGroupGloo(store, rank, 2, timeout)``), never through
``torch.distributed.init_process_group``, so nothing here touches the process-wide default group:
a worker may stream several models at once, or already be in a group of its own.

The wire protocol of a link, in order: the plan's length (an int64 header with a magic number and
a version), the plan's bytes, every chunk of the plan (tag ``CHUNK_TAG_BASE + i``), and at the end
an ack from the downstream side (the number of chunks it received), so a sender knows its
neighbour has everything before it lets the link go.

Every failure -- a peer that never connects, a connection closed by a crashed peer, an operation
that makes no progress for `timeout_s` -- comes out as `PeerStreamError` naming the peer and the
layer, so a caller can fall back to the tier loader. Note that with gloo a timed-out operation
closes the connection: a link is not usable after any error.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_MAGIC = 0x7468617773747265  # "thawstre"
_PROTOCOL_VERSION = 1
_HEADER_TAG = 0
_PLAN_TAG = 1
_ACK_TAG = 2
CHUNK_TAG_BASE = 3
BACKENDS = ("gloo", "nccl")


class PeerStreamError(RuntimeError):
    """A peer of a parameter stream died, stalled, never connected or sent something unreadable.

    `peer_rank` is the rank of the peer the link was with (0 the source), `layer` the layer being
    transferred when it happened (None before the first chunk). The caller should fall back to
    loading from the tier (SSD/DRAM/remote storage).
    """

    def __init__(self, message: str, *, peer_rank: int, layer: int | None):
        super().__init__(message)
        self.peer_rank = peer_rank
        self.layer = layer


def _timedelta(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s)


def connect_store(host: str, port: int, timeout_s: float, *, rank: int, peer_rank: int) -> dist.TCPStore:
    """A client connection to the stream's rendezvous store (one per link: a blocking store
    request holds the connection, so two links must not share one)."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=_timedelta(timeout_s))
    except (RuntimeError, OSError) as exc:
        raise PeerStreamError(f"rank {rank} could not reach the stream's rendezvous store at {host}:{port} "
                              f"(is the source still up?): {exc}", peer_rank=peer_rank, layer=None) from exc


def _new_group(backend: str, store: dist.Store, group_rank: int, timeout_s: float) -> dist.ProcessGroup:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, group_rank, 2, _timedelta(timeout_s))
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ValueError("StreamConfig.backend is 'nccl' but this torch build has no NCCL; use 'gloo' on CPU")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _timedelta(timeout_s)
        return dist.ProcessGroupNCCL(store, group_rank, 2, options)
    raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")


class PeerLink:
    """The link between chain neighbours `rank` and `peer_rank` (they differ by one) of stream
    `transfer_id`. Construction blocks until the peer builds its end too (at most `timeout_s`).

    Tensors passed to `send`/`recv` must live on `device` (CPU for gloo, the GPU for NCCL) and be
    kept alive, unmodified, until the returned work has been waited on.
    """

    def __init__(self, store: dist.Store, *, transfer_id: str, rank: int, peer_rank: int, backend: str,
                 timeout_s: float, device: torch.device | str = "cpu"):
        if abs(rank - peer_rank) != 1:
            raise ValueError(f"PeerLink joins chain neighbours; ranks {rank} and {peer_rank} are not adjacent")
        self.rank, self.peer_rank = rank, peer_rank
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self._role = "downstream" if peer_rank > rank else "upstream"
        prefix = f"thaw-stream/{transfer_id}/link-{min(rank, peer_rank)}"
        try:
            self._group = _new_group(backend, dist.PrefixStore(prefix, store), int(rank > peer_rank), timeout_s)
        except RuntimeError as exc:
            raise PeerStreamError(f"rank {rank} could not connect to its {self._role} peer rank {peer_rank} "
                                  f"within {timeout_s} s: {exc}", peer_rank=peer_rank, layer=None) from exc
        self._group_peer = int(rank < peer_rank)

    def close(self) -> None:
        """Let the connection go (the peer's pending operations fail). The link is unusable after."""
        self._group = None

    def _failure(self, exc: BaseException, what: str, layer: int | None) -> PeerStreamError:
        at = f" at layer {layer}" if layer is not None else ""
        return PeerStreamError(f"rank {self.rank}: {what} {'to' if self._role == 'downstream' else 'from'} "
                               f"{self._role} peer rank {self.peer_rank}{at} failed (peer died, stalled for "
                               f"{self.timeout_s} s or disconnected): {exc}", peer_rank=self.peer_rank, layer=layer)

    def send(self, tensor: torch.Tensor, tag: int, *, layer: int | None = None) -> dist.Work:
        try:
            return self._group.send([tensor], self._group_peer, tag)
        except RuntimeError as exc:
            raise self._failure(exc, "sending", layer) from exc

    def recv(self, tensor: torch.Tensor, tag: int, *, layer: int | None = None) -> dist.Work:
        try:
            return self._group.recv([tensor], self._group_peer, tag)
        except RuntimeError as exc:
            raise self._failure(exc, "receiving", layer) from exc

    def wait(self, work: dist.Work, what: str, *, layer: int | None = None) -> None:
        """Wait for `work`; an error or `timeout_s` without completion raises PeerStreamError."""
        try:
            work.wait(_timedelta(self.timeout_s))
        except RuntimeError as exc:
            raise self._failure(exc, what, layer) from exc

    # -- the protocol's small messages -----------------------------------------------------------

    def send_plan(self, plan_bytes: bytes) -> None:
        header = torch.tensor([_MAGIC, _PROTOCOL_VERSION, len(plan_bytes)], dtype=torch.int64, device=self.device)
        payload = torch.frombuffer(bytearray(plan_bytes), dtype=torch.uint8).to(self.device)  # [len] uint8
        self.wait(self.send(header, _HEADER_TAG), "sending the plan header")
        self.wait(self.send(payload, _PLAN_TAG), "sending the plan")

    def recv_plan(self) -> bytes:
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        self.wait(self.recv(header, _HEADER_TAG), "receiving the plan header")
        magic, version, num_bytes = header.tolist()
        if magic != _MAGIC or version != _PROTOCOL_VERSION:
            raise PeerStreamError(f"rank {self.rank}: upstream peer rank {self.peer_rank} speaks stream protocol "
                                  f"{magic:#x}/v{version}, this Thaw speaks {_MAGIC:#x}/v{_PROTOCOL_VERSION}",
                                  peer_rank=self.peer_rank, layer=None)
        payload = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        self.wait(self.recv(payload, _PLAN_TAG), "receiving the plan")
        return payload.cpu().numpy().tobytes()

    def send_ack(self, num_chunks: int) -> None:
        ack = torch.tensor([num_chunks], dtype=torch.int64, device=self.device)
        self.wait(self.send(ack, _ACK_TAG), "acknowledging the stream")

    def recv_ack(self, num_chunks: int, *, layer: int | None) -> None:
        ack = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.wait(self.recv(ack, _ACK_TAG), "waiting for the acknowledgement", layer=layer)
        if int(ack.item()) != num_chunks:
            raise PeerStreamError(f"rank {self.rank}: downstream peer rank {self.peer_rank} acknowledged "
                                  f"{int(ack.item())} chunks, {num_chunks} were sent",
                                  peer_rank=self.peer_rank, layer=layer)
