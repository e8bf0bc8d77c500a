"""A sleeping engine's weights, parked in host memory and copied back to the device when it wakes.

Why (issue 38, Build 4 "Sleep before evict"): an idle GPU instance whose memory another model needs
need not be stopped. Its engine frees the KV pool and moves its weights into pinned host memory,
and waking it is one copy back at the pinned link's rate (tens of GB/s) instead of a load from
the node's tiers. vLLM's sleep mode level 1 is the model: weights offloaded to CPU, KV discarded.

Our difference: vLLM allocates the weights through its own allocator (``CuMemAllocator``), which
keeps their virtual addresses and only unmaps and remaps the physical memory behind them, so
every pointer a CUDA graph captured stays valid. We use torch's caching allocator, so the weights
come back at new addresses: every tensor that viewed the old memory is re-pointed here, in place
(``tensor.data = ...``: the ``Parameter`` objects the modules hold stay the same objects, only their
storage changes), and whatever captured addresses must go. That is the runner's decode graphs,
dropped with the KV pool (`ModelRunner.release_kv_pool`) and made anew, empty, after the weights
are back (`ModelRunner.restore_kv_pool`), each batch size captured on its first use.

What moves: every strided tensor on the device that the model's modules hold -- parameters,
buffers and plain tensor attributes (`kernels.cpu_linear.PrepackedLinear`'s plain weight and bias);
MoE experts are stacked parameters like any other. Tensors that share memory (a tied head and its
embedding, a packed head's plain copy of the embedding, views into one loader buffer) are grouped
by storage, the overlapping byte ranges of a group copied once, and every tensor re-pointed at the
same offset into that one copy: they still share after the copy back, and shared bytes count once.
Opaque layouts (oneDNN's packed weights) exist only on a CPU, already in host memory: they stay.

The device memory goes when nothing else holds it: a view taken before the move (a loader that
kept its buffer) keeps the old memory alive, and that copy is not what the engine reads any more.
On an accelerator the freed blocks are handed back to the driver (``empty_cache``), so another
process can have them. Pinned: all of it in one page-locked buffer; the copies back are
``non_blocking`` with one synchronize at the end, and then the buffer goes back to the OS (torch
would otherwise keep it cached, held by an instance that is awake). torch's pinned allocator
rounds an allocation up to a power of two (unless ``PYTORCH_ALLOC_CONF`` sets
``pinned_max_round_threshold_mb``), so one buffer for the lot rounds once, and an instance asleep
holds up to that much host memory (16 GiB for anything over 8 and up to 16 GiB of weights).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
from torch import nn

# Each piece starts at a multiple of every element size, so a tensor's offset in it is whole elements.
_ALIGN_BYTES = 16


@dataclass(frozen=True)
class _Piece:
    """One byte range that some of the model's tensors view, and where it lies in the host buffer.
    `views`: each tensor with its byte offset from the range's start."""

    num_bytes: int
    host_offset: int  # byte offset in the host buffer (a multiple of _ALIGN_BYTES)
    views: tuple[tuple[torch.Tensor, int], ...]


class HostWeights:
    """Moves one model's weights between its device and host memory (see the module docstring).

    `pin_memory`: page-locked host memory, for copies at the link's full rate (a CUDA device
    only). The tensors are found at each `offload`, so weights assigned or packed after this is
    built (a layer gate, deferred packing) move too. Single threaded: the caller (the engine's
    thread) moves the weights while no forward pass runs."""

    def __init__(self, model: nn.Module, device: torch.device, *, pin_memory: bool) -> None:
        if pin_memory and device.type == "cpu":
            raise ValueError("pin_memory needs an accelerator device: a CPU model's weights are in host memory "
                             "already")
        if device.type != "cpu" and device.index is None:  # "cuda" is the current one; its tensors say "cuda:0"
            device = torch.device(device.type, torch.accelerator.current_device_index())
        self.model = model
        self.device = device
        self.pin_memory = pin_memory
        self._non_blocking = pin_memory  # an asynchronous copy needs page-locked host memory
        self._accelerator = device.type != "cpu"  # chosen once: whether there is a device to synchronize
        self._host: torch.Tensor | None = None  # [num_host_bytes] uint8 while the weights are away
        self._pieces: list[_Piece] = []
        self.num_bytes = 0  # bytes of the last move
        self.offload_s = 0.0  # seconds of the last move to the host (its buffer's allocation included)
        self.restore_s = 0.0  # seconds of the last copy back (not counting the host buffer's release)

    @property
    def on_host(self) -> bool:
        return self._host is not None

    def offload(self) -> int:
        """Copies the weights into host memory and re-points the model at that copy, so the device
        copies are freed; returns the bytes moved. At once (0) when they are on the host already."""
        if self._host is not None:
            return 0
        start_s = time.perf_counter()
        self._host, self._pieces = self._copy_out()
        if self._accelerator:
            torch.accelerator.empty_cache()  # the freed blocks back to the driver, for other processes too
        self.num_bytes = sum(p.num_bytes for p in self._pieces)
        self.offload_s = time.perf_counter() - start_s
        return self.num_bytes

    def _copy_out(self) -> tuple[torch.Tensor, list[_Piece]]:
        """The host buffer holding every piece, and the pieces, now pointing at it (no device
        storage among them: once this returns, nothing here holds the device copies)."""
        ranges = _ranges(_device_tensors(self.model, self.device))
        pieces = [piece for _, _, piece in ranges]
        host = torch.empty(sum(_aligned(p.num_bytes) for p in pieces), dtype=torch.uint8,
                           pin_memory=self.pin_memory)  # [host bytes]
        for storage, start, piece in ranges:
            source = _bytes_of(storage, self.device)[start:start + piece.num_bytes]  # [n] uint8
            host[piece.host_offset:piece.host_offset + piece.num_bytes].copy_(source, non_blocking=self._non_blocking)
        self._synchronize()  # every byte is on the host before the device copy may go
        for piece in pieces:
            _point(piece.views, host.untyped_storage(), piece.host_offset)
        return host, pieces

    def restore(self) -> int:
        """Copies the weights back into fresh device memory and re-points the model at it, then lets
        the host copy go; returns the bytes moved. At once (0) when they are on the device."""
        host = self._host
        if host is None:
            return 0
        start_s = time.perf_counter()
        for piece in self._pieces:
            device_bytes = torch.empty(piece.num_bytes, dtype=torch.uint8, device=self.device)  # [n]
            device_bytes.copy_(host[piece.host_offset:piece.host_offset + piece.num_bytes],
                               non_blocking=self._non_blocking)
            _point(piece.views, device_bytes.untyped_storage(), 0)
        self._synchronize()  # the host buffer may go only once every copy from it is done
        self.restore_s = time.perf_counter() - start_s  # the copy's time; giving the buffer back is not
        self._host, self._pieces = None, []
        del host
        if self.pin_memory:
            torch.accelerator.empty_host_cache()  # page-locked memory back to the OS, not kept in torch's cache
        return self.num_bytes

    def _synchronize(self) -> None:
        if self._accelerator:
            torch.accelerator.synchronize(self.device)


def _device_tensors(model: nn.Module, device: torch.device) -> list[torch.Tensor]:
    """Every strided, non-empty tensor on `device` that the model's modules hold (parameters,
    buffers, plain attributes), each tensor object once."""
    attributes = (value for module in model.modules() for value in vars(module).values())
    found: dict[int, torch.Tensor] = {}
    for value in itertools.chain(model.parameters(), model.buffers(), attributes):
        if (isinstance(value, torch.Tensor) and value.layout == torch.strided and value.device == device
                and value.numel() > 0):
            found.setdefault(id(value), value)
    return list(found.values())


def _ranges(tensors: list[torch.Tensor]) -> list[tuple[torch.UntypedStorage, int, _Piece]]:
    """The byte ranges the tensors view as (device storage, byte offset in it, piece), storage by
    storage, overlapping ranges merged into one (so shared bytes are copied once), the pieces laid
    end to end in the host buffer."""
    by_storage: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        storages.setdefault(key, storage)
        start = tensor.storage_offset() * tensor.element_size()
        extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        by_storage.setdefault(key, []).append((start, start + extent * tensor.element_size(), tensor))
    found: list[tuple[torch.UntypedStorage, int, _Piece]] = []
    host_offset = 0
    for key, ranges in by_storage.items():
        ranges.sort(key=lambda r: r[0])
        merged: list[list] = []  # [start, end, [tensor, ...]]
        for start, end, tensor in ranges:
            if merged and start < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
                merged[-1][2].append(tensor)
            else:
                merged.append([start - start % _ALIGN_BYTES, end, [tensor]])
        for start, end, members in merged:
            views = tuple((t, t.storage_offset() * t.element_size() - start) for t in members)
            found.append((storages[key], start, _Piece(end - start, host_offset, views)))
            host_offset += _aligned(end - start)
    return found


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN_BYTES) * _ALIGN_BYTES


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:  # [storage bytes] uint8
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _point(views: tuple[tuple[torch.Tensor, int], ...], storage: torch.UntypedStorage, base: int) -> None:
    """Re-points each tensor, in place, at `storage` from byte `base` plus its offset, keeping its
    shape and strides. Through ``.data``, because `Tensor.set_` refuses a storage on another device;
    the new view is made in the tensor's own mode, since an inference tensor takes only an
    inference tensor's data (and a normal one only a normal one's)."""
    for tensor, offset in views:
        with torch.inference_mode(tensor.is_inference()):
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=storage.device).set_(
                storage, (base + offset) // tensor.element_size(), tensor.shape, tensor.stride())
