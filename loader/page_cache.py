"""How much of a file range the page cache already holds, asked without causing any I/O.

Why not just try a ``RWF_NOWAIT`` read: on a miss the kernel still starts readahead for the
range before it answers ``EAGAIN`` (measured: 8 MiB read from disk for one refused probe), so a
cold load probed every chunk, read each chunk again with ``O_DIRECT``, and moved ~13% more bytes
off the disk than the checkpoint holds. ``mincore(2)`` on a mapping of the range reports which
pages are resident and never reads, maps or faults a page in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import re

_PAGE = mmap.PAGESIZE
_PROT_READ, _MAP_SHARED = mmap.PROT_READ, mmap.MAP_SHARED
_MAP_FAILED = ctypes.c_void_p(-1).value
_RESIDENT_BIT = bytes(i & 1 for i in range(256))  # a mincore byte -> its "resident" bit
_RESIDENT_RUN = re.compile(b"\x01+")


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def residency_supported() -> bool:
    """True where `resident_runs` can answer (Linux with a C library exposing mincore)."""
    return _LIBC is not None


def resident_runs(fd: int, offset: int, length: int) -> list[tuple[int, int]]:
    """The runs of ``[offset, offset + length)`` of ``fd``'s file whose pages are in the page cache,
    as ``(start, end)`` byte offsets relative to ``offset``, in order (ends clipped to ``length``).
    ``offset`` must be page-aligned. Raises OSError when the range cannot be mapped (callers then
    read normally).

    Runs, not just a prefix: on some hosts (a VM whose balloon takes back free memory) the kernel
    drops single pages of a cached file all the time; a reader that stopped at the first missing
    page read the rest of a 64 MiB chunk from disk for one 4 KiB hole."""
    if _LIBC is None:
        raise OSError("mincore is not available on this platform")
    if offset % _PAGE:
        raise ValueError(f"offset {offset} is not a multiple of the page size {_PAGE}")
    if length <= 0:
        return []
    addr = _LIBC.mmap(None, length, _PROT_READ, _MAP_SHARED, fd, offset)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap for a page-cache query failed: {os.strerror(err)}")
    try:
        num_pages = -(-length // _PAGE)
        vec = (ctypes.c_ubyte * num_pages)()
        if _LIBC.mincore(addr, length, vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore failed: {os.strerror(err)}")
        resident = bytes(vec)
    finally:
        _LIBC.munmap(addr, length)
    # Bit 0 of each byte: page resident (the others are undefined). Runs are found in C (a Python
    # loop over the pages cost ~0.1 s per GB): the regex engine walks the 0/1 map once.
    return [(m.start() * _PAGE, min(m.end() * _PAGE, length))
            for m in _RESIDENT_RUN.finditer(resident.translate(_RESIDENT_BIT))]


def resident_prefix_bytes(fd: int, offset: int, length: int) -> int:
    """Bytes of the range, counted from ``offset``, whose pages are all cached (0 when the first
    page is not); see `resident_runs`."""
    runs = resident_runs(fd, offset, length)
    return runs[0][1] if runs and runs[0][0] == 0 else 0
