"""How KV blocks travel from a migration's source to its destination, behind one small interface.

The source calls `send` with the blocks it read between two steps and gets a `KVPayload`, a small
record it can hand to whoever drives the migration; the destination calls `receive` on that record
and gets the blocks back, ready to write into its pool. What the payload carries depends on the
channel:

* `InProcessKVTransport`: the tensor itself (both engines in one process: tests, benchmarks);
* `RayObjectKVTransport`: a Ray object reference. The source puts the blocks into Ray's object
  store once, from its own process; the driver passes the reference along without fetching the
  bytes; the destination reads them from the store (zero-copy on the same node, one network copy
  otherwise). The blocks go through the store as a flat byte array rather than a pickled tensor,
  which is what makes the read zero-copy, and works for every dtype (bfloat16 has no NumPy type).

`torch.distributed` (gloo on CPU, NCCL on CUDA) would be a third implementation: ``send`` a
``dist.isend`` to the destination's rank with a tag in the payload, ``receive`` the matching
``dist.irecv``. It needs a process group spanning the instances, which the platform does not set
up yet, so it is not here.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = ["InProcessKVTransport", "KVPayload", "KVTransport", "RayObjectKVTransport"]


@dataclass(frozen=True)
class KVPayload:
    """KV blocks on their way: what they are, and the data (or where to fetch it)."""

    shape: tuple[int, ...]  # [L, 2, n, block_size, Hkv, D]
    dtype: str  # torch dtype name, e.g. "float32"
    data: Any = field(repr=False)  # a tensor in process; a Ray ObjectRef across processes

    @property
    def num_blocks(self) -> int:
        return self.shape[2]

    @property
    def num_bytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


class KVTransport(Protocol):
    def send(self, kv: torch.Tensor) -> KVPayload:
        """On the source: ships kv [L, 2, n, block_size, Hkv, D]; returns what the destination needs."""
        ...

    async def receive(self, payload: KVPayload) -> torch.Tensor:
        """On the destination: the blocks ``send`` shipped, [L, 2, n, block_size, Hkv, D]."""
        ...


class InProcessKVTransport:
    """Source and destination share a process: the tensor (already a copy of the blocks) is the payload."""

    def send(self, kv: torch.Tensor) -> KVPayload:
        return KVPayload(tuple(kv.shape), _dtype_name(kv.dtype), kv)

    async def receive(self, payload: KVPayload) -> torch.Tensor:
        return payload.data

    async def keep(self, payload: KVPayload) -> KVPayload:
        """A payload of this process's own (here the tensor already is)."""
        return payload


class RayObjectKVTransport:
    """Through Ray's object store (see the module docstring). ``send`` must run where Ray is
    initialised (in an actor, it is); the payload's reference is owned by the sending process."""

    def send(self, kv: torch.Tensor) -> KVPayload:
        import ray

        flat = kv.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)  # [numel * element_size]
        return KVPayload(tuple(kv.shape), _dtype_name(kv.dtype), ray.put(flat.numpy()))

    async def receive(self, payload: KVPayload) -> torch.Tensor:
        array = await payload.data  # a read-only view of the object store's copy
        dtype = getattr(torch, payload.dtype)
        if array.size == 0:  # torch.frombuffer refuses an empty buffer
            return torch.empty(payload.shape, dtype=dtype)
        with warnings.catch_warnings():
            # torch warns that the buffer is read-only; the blocks are only ever copied out of it.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(array, dtype=torch.uint8)  # [numel * element_size]
        return flat.view(dtype).reshape(payload.shape)

    async def keep(self, payload: KVPayload) -> KVPayload:
        """The same blocks under a reference this process owns: an object lives only as long as the
        process that put it, so a payload kept past its source's death (a parked request whose
        instance stopped, `migration.parking_endpoint`) is read and put again here."""
        import ray

        return KVPayload(payload.shape, payload.dtype, ray.put(await payload.data))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
