"""Whether a path lives on a memory-backed filesystem (tmpfs, ramfs, hugetlbfs), and mapping it.

The node's DRAM tier keeps checkpoints as files in tmpfs (see `storage.shm_directory`). Reading
such a file copies pages that already sit in RAM into a second buffer: for a 1 GB model that copy
(with its checksums) was ~0.2 s of a 0.66 s cold start on the dev machine kind. Mapping the file
instead makes the tensors views of the tier's own pages: no copy, nothing to fault in but page
tables, and every instance of the model on the node shares one physical copy. That is safe only
where the pages cannot be evicted back to a disk and re-read (tmpfs pages live in RAM, or in swap
like any anonymous memory): mapping an ext4 file would make "loaded" mean "in the page cache
until the kernel needs the memory", which is why disk files are still read into owned memory.

The filesystem type comes from ``/proc/self/mountinfo`` (the longest mount point that contains
the path); `mount_fs_type` is the pure parser, tested on text.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import warnings
from pathlib import Path

import torch

MEMORY_BACKED_FS_TYPES = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
# Linux 5.14+: fault a range in (page tables too) without touching it. Python 3.11 lacks the name.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None)


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040 ...)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_fs_type(mountinfo: str, path: str) -> str | None:
    """The filesystem type of the mount holding absolute `path`, from mountinfo text (None: no match).

    A mountinfo line is ``id parent major:minor root mount_point options [optional...] - fstype source
    super_options``; later lines mount over earlier ones at the same point, so the last longest match wins.
    """
    best_len, best_type = -1, None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        mount_point = _unescape(fields[4])
        fs_type = fields[fields.index("-", 6) + 1]
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= best_len:
            best_len, best_type = len(mount_point), fs_type
    return best_type


def is_memory_backed(path: str | Path) -> bool:
    """Whether `path` is on tmpfs/ramfs/hugetlbfs (False where mountinfo cannot be read)."""
    try:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
    except OSError:
        return False
    return mount_fs_type(mountinfo, os.path.realpath(path)) in MEMORY_BACKED_FS_TYPES


def map_read_only(path: str | Path, num_bytes: int) -> torch.Tensor:
    """The first `num_bytes` of `path` as a read-only shared mapping, [num_bytes] uint8.

    The tensor keeps the mapping alive (it holds the buffer); the file may be unlinked meanwhile
    and its pages stay until the last view is gone. Writing through it faults (SIGSEGV): weights
    are never written in place, and a bug that tried would otherwise corrupt every instance
    sharing the pages.
    """
    if num_bytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # "non-writable buffer": intended, see above
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)  # [num_bytes] uint8


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def populate(mapped: torch.Tensor, start: int, length: int) -> None:
    """Fault pages [start, start + length) of a mapping in (page tables included) without copying."""
    if length <= 0:
        return
    if MADV_POPULATE_READ is not None:
        page = mmap.PAGESIZE
        address = mapped.data_ptr() + start
        aligned = address - address % page
        try:  # madvise on the tensor's address: the mmap object is reachable only through the tensor
            if _libc().madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(length + address - aligned),
                            MADV_POPULATE_READ) == 0:
                return
        except (OSError, AttributeError):
            pass
    mapped[start:start + length:mmap.PAGESIZE].sum()  # older kernels: touch one byte per page
