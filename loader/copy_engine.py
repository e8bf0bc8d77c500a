"""The copy engine: what `DeviceLoader` needs from a device, and its CUDA implementation.

The loader's pipeline (readers fill staging buffers, copies run while the next reads do, a buffer
is reused only once its copy has completed) is the same on every device; only five operations
differ, and they are this protocol: allocate the destination, allocate page-locked host memory,
register existing host pages with the device (and undo it), and start an asynchronous copy that
returns a `Completion` to wait on. Injecting it keeps the pipeline testable on a CPU-only machine:
the tests' engine copies into CPU memory and completes each copy only when the test says so,
which makes ordering, back-pressure, errors and teardown deterministic.

`CudaCopyEngine` is the real one: copies are ``copy_(non_blocking=True)`` on a few CUDA streams
(round robin: the DMA engines overlap one copy's tail with the next one's setup), each followed by
an event whose ``synchronize()`` is the completion. Host registration is ``cudaHostRegister`` with
``cudaHostRegisterReadOnly``, because the DRAM tier's pages are mapped read-only
(`loader.memory_backed.map_read_only`): registered pages are DMA'd straight to the device, with
no staging copy. This file is the loader's only user of ``torch.cuda``.
"""

from __future__ import annotations

import itertools
from typing import Protocol, runtime_checkable

import torch

# cuda_runtime_api.h: cudaHostRegisterReadOnly. The pointer is to memory the device only reads;
# required to register a read-only mapping (the DRAM tier's pages are mapped PROT_READ).
CUDA_HOST_REGISTER_READ_ONLY = 0x08
MAX_STREAMS = 64


@runtime_checkable
class Completion(Protocol):
    """One asynchronous copy in flight."""

    def wait(self) -> None:
        """Block until the copy has finished (its source may then be reused); raises if it failed."""
        ...


@runtime_checkable
class CopyEngine(Protocol):
    """A device the loader copies to; see the module docstring."""

    device: torch.device

    def allocate_device(self, num_bytes: int) -> torch.Tensor:
        """A ``[num_bytes]`` uint8 destination on the device, ready for copies from any stream."""
        ...

    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        """A ``[num_bytes]`` uint8 host buffer the device can copy from asynchronously (pinned)."""
        ...

    def register_host(self, tensor: torch.Tensor) -> bool:
        """Page-lock existing, read-only host memory for direct copies; False where that is not possible."""
        ...

    def unregister_host(self, tensor: torch.Tensor) -> None:
        """Undo `register_host` (once no copy from it is in flight)."""
        ...

    def copy_async(self, destination: torch.Tensor, source: torch.Tensor) -> Completion:
        """Start copying `source` (host, pinned or registered) into `destination` (device, same size)."""
        ...


class _EventCompletion:
    def __init__(self, event) -> None:
        self._event = event

    def wait(self) -> None:
        self._event.synchronize()  # releases the GIL while it waits


class CudaCopyEngine:
    """Copies to one CUDA device on `num_streams` streams; see the module docstring."""

    def __init__(self, device: torch.device | str = "cuda", num_streams: int = 2):
        if not isinstance(num_streams, int) or isinstance(num_streams, bool) or not 1 <= num_streams <= MAX_STREAMS:
            raise ValueError(f"CudaCopyEngine num_streams is {num_streams!r}; use an integer in 1..{MAX_STREAMS} "
                             f"(default 2)")
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaCopyEngine needs a CUDA device, got {str(device)!r}; "
                             f"on other devices load with loader.load_checkpoint and move the tensors")
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} was requested but this machine has no usable CUDA device")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self._streams = [torch.cuda.Stream(self.device) for _ in range(num_streams)]
        self._next_stream = itertools.count()  # next() is atomic under the GIL: safe from reader threads
        self._cudart = torch.cuda.cudart()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def allocate_device(self, num_bytes: int) -> torch.Tensor:
        buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)  # [num_bytes]
        # Allocated in the current stream's order: the copy streams start after whatever that
        # stream still does with this memory's previous owner.
        current = torch.cuda.current_stream(self.device)
        for stream in self._streams:
            stream.wait_stream(current)
        return buffer

    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)  # [num_bytes]

    def register_host(self, tensor: torch.Tensor) -> bool:
        if tensor.numel() == 0:
            return False
        error = self._cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                              CUDA_HOST_REGISTER_READ_ONLY)
        return int(error) == 0

    def unregister_host(self, tensor: torch.Tensor) -> None:
        # An error here leaves the pages locked until the mapping goes away; nothing to recover.
        self._cudart.cudaHostUnregister(tensor.data_ptr())

    def copy_async(self, destination: torch.Tensor, source: torch.Tensor) -> Completion:
        stream = self._streams[next(self._next_stream) % len(self._streams)]
        with torch.cuda.stream(stream):
            destination.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return _EventCompletion(event)
