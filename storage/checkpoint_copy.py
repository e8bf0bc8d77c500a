"""Copying a thaw checkpoint between tiers while verifying every chunk's checksum.

Promoting a model from the SSD cache to the DRAM cache reads every byte anyway, so it verifies
each chunk against the index's xxh3_64 on the way (the digest is updated piece by piece, so a
thread holds one small buffer, not a 64 MiB chunk): a bit flipped on the SSD is caught at
promotion, raised as the loader's own `ChecksumMismatchError`, and the store re-fetches the
model instead of spreading the corruption into shared memory. Chunks are copied on a small thread
pool (``preadv``/``pwrite`` release the GIL; xxh3 too). The index is written last, so a copy
that stops early is never a readable checkpoint. The copy is the owner's only (directories 0700,
files 0600), as every tier's files are.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from loader import (PRIVATE_DIR_MODE, ChecksumMismatchError, ThawIndex, TruncatedCheckpointError, copy_private,
                    make_private_dirs, open_private)
from loader.verification_record import RECORD_FILE
from storage.model_repository import THAW_INDEX_FILE

_PIECE_BYTES = 8 << 20


def checkpoint_bytes(ckpt_dir: Path) -> int:
    """Bytes a checkpoint dir occupies: the sum of its files' sizes (what a tier's capacity counts)."""
    return sum(p.stat().st_size for p in ckpt_dir.rglob("*") if p.is_file())


def _copy_chunk(src_fd: int, dst_fd: int, src_path: Path, index: ThawIndex, partition: int, chunk: int,
                verify: bool, buffers: threading.local) -> None:
    entry = index.partitions[partition].chunks[chunk]
    buffer = getattr(buffers, "buffer", None)
    if buffer is None:
        buffer = buffers.buffer = memoryview(bytearray(_PIECE_BYTES))
    digest = xxhash.xxh3_64()
    done = 0
    while done < entry.size:
        want = min(_PIECE_BYTES, entry.size - done)
        n = os.preadv(src_fd, [buffer[:want]], entry.offset + done)
        if n == 0:
            raise TruncatedCheckpointError(f"{src_path} ended at byte {entry.offset + done}; the index expects "
                                           f"{index.partitions[partition].size}")
        if verify:
            digest.update(buffer[:n])
        os.pwrite(dst_fd, buffer[:n], entry.offset + done)
        done += n
    if verify and digest.hexdigest() != entry.xxh3_64:
        raise ChecksumMismatchError(f"{src_path}: chunk {chunk} (bytes [{entry.offset}, {entry.offset + entry.size}))"
                                    f" has xxh3_64 {digest.hexdigest()}, the index says {entry.xxh3_64}")


def copy_checkpoint(src_dir: Path, dst_dir: Path, *, verify: bool = True, num_threads: int = 4) -> ThawIndex:
    """Copy the thaw checkpoint in `src_dir` to `dst_dir` (created; must not exist); returns its index.

    Raises the loader's `ChecksumMismatchError` / `TruncatedCheckpointError` /
    `CheckpointFormatError` if the source is damaged; `dst_dir` is then incomplete (no index)."""
    index = ThawIndex.read(src_dir)
    make_private_dirs(dst_dir.parent)
    dst_dir.mkdir(mode=PRIVATE_DIR_MODE)
    partition_files = {p.file for p in index.partitions}
    for path in sorted(src_dir.rglob("*")):
        rel = path.relative_to(src_dir)
        # Not the source's verification record: it names the source's files (see loader.verification_record).
        if (path.is_file() and rel.as_posix() not in partition_files and rel.as_posix() != THAW_INDEX_FILE
                and rel.name != RECORD_FILE):
            make_private_dirs((dst_dir / rel).parent)
            copy_private(path, dst_dir / rel)
    fds: list[int] = []
    try:
        tasks = []
        for p_idx, p in enumerate(index.partitions):
            src_path = src_dir / p.file
            try:
                src_fd = os.open(src_path, os.O_RDONLY)
            except FileNotFoundError:
                raise TruncatedCheckpointError(f"{src_path} is missing (the index expects {p.size} bytes)") from None
            fds.append(src_fd)
            if os.fstat(src_fd).st_size < p.size:
                raise TruncatedCheckpointError(f"{src_path} is truncated: {os.fstat(src_fd).st_size} bytes, "
                                               f"the index expects {p.size}")
            dst_fd = open_private(dst_dir / p.file)
            fds.append(dst_fd)
            os.ftruncate(dst_fd, p.size)
            tasks += [(src_fd, dst_fd, src_path, p_idx, c) for c in range(len(p.chunks))]
        buffers = threading.local()
        with ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="thaw-copy") as pool:
            futures = [pool.submit(_copy_chunk, s, d, path, index, p, c, verify, buffers)
                       for s, d, path, p, c in tasks]
            for future in futures:
                future.result()
    finally:
        for fd in fds:
            os.close(fd)
    copy_private(src_dir / THAW_INDEX_FILE, dst_dir / THAW_INDEX_FILE)
    return index
