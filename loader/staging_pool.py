"""A small, fixed pool of page-locked host buffers that stage checkpoint bytes on their way to a device.

Why a bounded pool: a host-to-device copy runs asynchronously only from page-locked ("pinned")
memory, and pinning is slow (the kernel locks every page) and takes memory nobody else can use,
so a loader cannot pin a model-sized buffer per load. ServerlessLLM's answer, used here: a few
pinned buffers (default 16 x 16 MiB) that readers fill from storage while earlier buffers are
being copied to the device, each buffer going back to the pool only once its copy has completed.
When all buffers are in flight, a reader waits (`acquire` blocks): that back-pressure keeps the
readers at most `num_buffers` pieces ahead of the device, whatever the disk and link speeds are.

Buffers are allocated on first use by the `allocate` function given (a copy engine's pinned host
allocation; plain memory in tests), so a load that never stages (the DRAM tier, whose pages are
registered with the device instead) pins nothing; `allocate_all` allocates them ahead of demand
(a warm worker). Each buffer starts on a 4096-byte boundary, as ``O_DIRECT`` reads need.

A slot is an integer: `acquire` hands one out, `buffer(slot)` is its memory, `release(slot)`
returns it. Thread-safe; a waiting `acquire` gives up (returns None) as soon as its `stop()`
predicate holds, re-checked at every release and at every `wake()`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loader.format import ALIGNMENT_BYTES

MIB = 1 << 20
DEFAULT_NUM_BUFFERS = 16
DEFAULT_BUFFER_BYTES = 16 * MIB
HostAllocateFn = Callable[[int], torch.Tensor]  # num_bytes -> [num_bytes] uint8 host tensor


@dataclass(frozen=True)
class StagingConfig:
    """How many staging buffers, and how large. Every copy to the device is at most `buffer_bytes`."""

    num_buffers: int = DEFAULT_NUM_BUFFERS
    buffer_bytes: int = DEFAULT_BUFFER_BYTES

    def __post_init__(self) -> None:
        n = self.num_buffers
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1024:
            raise ValueError(f"StagingConfig.num_buffers is {n!r}; use an integer in 1..1024 "
                             f"(default {DEFAULT_NUM_BUFFERS})")
        size = self.buffer_bytes
        if (not isinstance(size, int) or isinstance(size, bool) or size < ALIGNMENT_BYTES
                or size % ALIGNMENT_BYTES):
            raise ValueError(f"StagingConfig.buffer_bytes is {size!r}; use a positive multiple of "
                             f"{ALIGNMENT_BYTES} (default {DEFAULT_BUFFER_BYTES} = 16 MiB)")

    @property
    def total_bytes(self) -> int:
        return self.num_buffers * self.buffer_bytes


class StagingPool:
    """`config.num_buffers` aligned host buffers of `config.buffer_bytes`, handed out as slots."""

    def __init__(self, config: StagingConfig, allocate: HostAllocateFn):
        self.config = config
        self._allocate = allocate
        self._cond = threading.Condition()
        self._free = list(range(config.num_buffers - 1, -1, -1))  # pop() hands out slot 0 first
        self._buffers: list[torch.Tensor | None] = [None] * config.num_buffers
        self._num_waiting = 0

    @property
    def num_free(self) -> int:
        with self._cond:
            return len(self._free)

    @property
    def num_waiting(self) -> int:
        """Threads blocked in `acquire` because every buffer is in use."""
        with self._cond:
            return self._num_waiting

    @property
    def num_allocated(self) -> int:
        with self._cond:
            return sum(b is not None for b in self._buffers)

    def acquire(self, stop: Callable[[], bool] = lambda: False) -> int | None:
        """A free slot, waiting while there is none; None once `stop()` is true (checked first).
        `stop` is called under the pool's lock: it must not take locks of its own."""
        with self._cond:
            self._num_waiting += 1
            try:
                self._cond.wait_for(lambda: stop() or bool(self._free))
            finally:
                self._num_waiting -= 1
            if stop():
                return None
            return self._free.pop()

    def buffer(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s ``[buffer_bytes]`` uint8 buffer, 4096-byte aligned, allocated on first use.
        Only the slot's holder may call this."""
        return self._ensure_buffer(slot)

    def allocate_all(self) -> None:
        """Allocate every buffer now (ahead of a load, so the load does not pay for pinning)."""
        for slot in range(self.config.num_buffers):
            self._ensure_buffer(slot)

    def _ensure_buffer(self, slot: int) -> torch.Tensor:
        with self._cond:
            buffer = self._buffers[slot]
        if buffer is None:
            new = self._new_buffer()  # outside the lock: pinning takes a while
            with self._cond:
                if self._buffers[slot] is None:
                    self._buffers[slot] = new
                buffer = self._buffers[slot]
        return buffer

    def _new_buffer(self) -> torch.Tensor:
        size = self.config.buffer_bytes
        raw = self._allocate(size + ALIGNMENT_BYTES)
        skip = -raw.data_ptr() % ALIGNMENT_BYTES
        return raw[skip: skip + size]  # [buffer_bytes] uint8, a view that keeps `raw` alive

    def release(self, slot: int) -> None:
        """Give `slot` back. Its buffer must no longer be read by any copy in flight."""
        with self._cond:
            if not 0 <= slot < self.config.num_buffers or slot in self._free:
                raise ValueError(f"release({slot}): not a slot this pool handed out, or released twice")
            self._free.append(slot)
            self._cond.notify_all()

    def wake(self) -> None:
        """Make every waiting `acquire` re-check its `stop()` predicate."""
        with self._cond:
            self._cond.notify_all()
