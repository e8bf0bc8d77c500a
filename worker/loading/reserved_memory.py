"""Host memory a spare worker faults in before it knows its model: `ReservedMemory`.

On this machine kind, memory touched for the first time costs a page fault per 4 KiB: measured,
~0.33 s to fault 1 GB of weight buffer and ~0.25 s to zero a 512 MiB KV pool, on the request's
path if the first load pays it. A spare worker (see `instance_worker_actor`) pays it while idle:

- ``weights``: a `loader.HostMemoryPool` with one pre-faulted block; the thaw loader reads the
  checkpoint straight into it when the model is at most that size (larger: a fresh buffer, as
  without a reservation);
- ``kv``: a zeroed byte buffer the engine carves its KV pool from when it is large enough (the
  pool must start zeroed: unwritten slots are masked, never read, but zeros keep a masked-out
  0 * garbage from ever being NaN).

Both are handed over once, to the one engine the worker hosts; the idle cost is their size in
resident memory, which is why the controller makes them configurable.
"""

from __future__ import annotations

import threading

import torch

from loader import HostMemoryPool


class ReservedMemory:
    """Pre-faulted weight pool and zeroed KV buffer (see the module docstring). Thread-safe."""

    def __init__(self, weight_bytes: int = 0, kv_bytes: int = 0) -> None:
        for name, value in (("weight_bytes", weight_bytes), ("kv_bytes", kv_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ReservedMemory.{name} must be an integer >= 0, got {value!r}")
        self.weight_bytes = weight_bytes
        self.kv_bytes = kv_bytes
        self._lock = threading.Lock()
        self.weights = HostMemoryPool()
        if weight_bytes:
            self.weights.reserve(weight_bytes)
        # [kv_bytes] uint8, zeroed (torch.zeros writes every page, so they are faulted too).
        self._kv: torch.Tensor | None = torch.zeros(kv_bytes, dtype=torch.uint8) if kv_bytes else None

    def take_kv_buffer(self, num_bytes: int) -> torch.Tensor | None:
        """The zeroed ``[num_bytes]`` uint8 buffer, once, if the reservation is large enough; else None."""
        with self._lock:
            if self._kv is None or self._kv.numel() < num_bytes:
                return None
            buffer, self._kv = self._kv[:num_bytes], None
            return buffer

    def __repr__(self) -> str:
        return f"ReservedMemory(weight_bytes={self.weight_bytes}, kv_bytes={self.kv_bytes})"
