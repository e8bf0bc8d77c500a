"""A dead tensor's pages given back to the OS while the buffer around it lives on: `release_pages`.

A thaw checkpoint is loaded into one host buffer and every tensor is a view of it (no copy,
`checkpoint_loader`). On CPU the engine then replaces each linear weight by a copy in oneDNN's
blocked layout (`kernels.cpu_linear.PrepackedLinear`): the plain weight is dead, but its bytes
stay resident as long as any other view of the buffer lives (the embedding, the norms), so a
bfloat16 model held its linear weights twice -- 1.41 GB for a 0.62 GB checkpoint, and a 16 GB
Llama-3-8B did not fit a 24 GB machine. ``madvise(MADV_DONTNEED)`` on the pages that lie wholly
inside the dead tensor returns them to the OS at once, so the model's memory stays one copy (plus
the layer being packed) all through the packing.

Only for a tensor nothing reads again: private anonymous pages read back as zeros afterwards. On
a shared file mapping (the DRAM tier's tmpfs pages) it only drops this process's page-table
entries; the file keeps its pages and a later read would fault them in again, unchanged. The
thaw format aligns every tensor to 4096 bytes, so a weight's pages are its own; a partial page
at either end (shared with a neighbour) is kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys

import torch

MADV_DONTNEED = 4  # Linux


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    function = libc.madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def release_pages(tensor: torch.Tensor) -> int:
    """Returns the pages wholly inside `tensor`'s bytes to the OS (see the module docstring);
    the bytes released (0 off Linux, off the CPU, or for a tensor smaller than a page). The
    caller guarantees that nothing reads the tensor again."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // page) * page
    last = end // page * page
    if last <= first:
        return 0
    if madvise(first, last - first, MADV_DONTNEED) != 0:
        return 0  # an address range the kernel refuses: the pages simply stay
    return last - first
