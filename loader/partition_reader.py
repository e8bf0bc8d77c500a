"""Positional reads of one partition file into host memory: page cache first, then O_DIRECT.

``O_DIRECT`` bypasses the page cache: a cold load does not copy every byte into the cache and then
again into our buffer, and does not evict other models' cached pages. But it also never *uses*
the cache: a file that is already cached (just downloaded, loaded a minute ago) is read from disk
again. Measured on the dev machine kind (~0.9 GB checkpoint, 4 threads, 64 MiB chunks): pure
O_DIRECT 1.2-1.3 GB/s (the disk) whether or not the file is cached; buffered reads of a cached
file 8.3 GB/s (5.3 with checksums). So with `direct_io` each read first takes what the page cache
already holds with ``RWF_NOWAIT`` (returns only cached bytes, never waits for the disk) and reads
the rest with ``O_DIRECT``: cached files load at memory speed (5.5 GB/s with checksums), cold
ones at disk speed without filling the cache. What is cached is asked with ``mincore`` first
(`page_cache.resident_runs`): a refused ``RWF_NOWAIT`` read still starts readahead, so
probing blindly made cold loads read ~13% more bytes from disk than the checkpoint holds; the
buffered descriptor is also marked ``POSIX_FADV_RANDOM`` so copying a cached range never
schedules readahead of the uncached rest.

The answer is every cached run, not a prefix: the dev VM's kernel drops single pages of cached
files all the time (~1% of a 1.7 GB file between two loads), and stopping at the first missing
page sent the rest of its 64 MiB chunk to the disk -- ~9% of a "warm" load read at disk speed,
most of its time. A hole between two cached runs shorter than `SMALL_HOLE_BYTES` is now read
through the page cache with its neighbours (the kernel fetches just the missing pages); only
larger holes and uncached ends of a range go to ``O_DIRECT``. (On this virtual disk buffered cold reads were
~10% faster than O_DIRECT, 1.41 vs 1.26 GB/s: `LoaderConfig(direct_io=False)` when the page
cache should keep the model as a free warm tier.)

``O_DIRECT`` needs aligned offsets, lengths and buffer addresses (the format and
`HostMemoryPool` guarantee 4096) and some filesystems refuse it (older tmpfs, some FUSE and
network mounts) with ``EINVAL`` -- at ``open`` or only at the first read. Either way the reader
carries on with buffered reads and `direct_io` reports False, so load statistics say which path
was taken.

Reads go through ``os.preadv`` (positional, so threads share the descriptors; it releases the GIL
while the kernel copies). ``open_fn`` and ``read_fn`` are injectable so tests can simulate a
filesystem without O_DIRECT or gate individual reads with events.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from loader.format import ALIGNMENT_BYTES, TruncatedCheckpointError
from loader.page_cache import residency_supported, resident_runs

OpenFn = Callable[[str, int], int]  # (path, flags) -> file descriptor, like os.open
ReadFn = Callable[[int, memoryview, int, int], int]  # (fd, destination, file offset, RWF_* flags) -> bytes read
# (fd, offset, length) -> the cached runs [(start, end)], relative to offset, in order; no I/O
ResidencyFn = Callable[[int, int, int], list[tuple[int, int]]]
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
DEFAULT_RESIDENCY_FN: ResidencyFn | None = resident_runs if residency_supported() else None
# A hole this short between two cached runs is read through the page cache with them: one small
# synchronous read, where O_DIRECT would split the copy in three for the same disk work.
SMALL_HOLE_BYTES = 1 << 20
Segment = tuple[int, int, bool]  # (start, end, buffered) relative to the range's offset


def plan_segments(cached_runs: list[tuple[int, int]], length: int,
                  small_hole_bytes: int = SMALL_HOLE_BYTES) -> list[Segment]:
    """How to read a range of `length` bytes given its cached runs: contiguous segments, buffered
    (cached runs and the short holes between them) or direct (every other hole, including the
    range's uncached start and end, which may continue into cold neighbours)."""
    segments: list[Segment] = []

    def add(start: int, end: int, buffered: bool) -> None:
        if end <= start:
            return
        if segments and segments[-1][2] == buffered and segments[-1][1] == start:
            segments[-1] = (segments[-1][0], end, buffered)
        else:
            segments.append((start, end, buffered))

    cursor = 0
    for start, end in cached_runs:
        interior = cursor > 0
        add(cursor, start, interior and start - cursor < small_hole_bytes)
        add(start, end, True)
        cursor = end
    add(cursor, length, False)
    return segments


def preadv_into(fd: int, destination: memoryview, offset: int, flags: int = 0) -> int:
    return os.preadv(fd, [destination], offset, flags)


class PartitionReader:
    """Reads byte ranges of one partition file into caller-provided buffers; thread-safe."""

    def __init__(self, path: str | Path, *, direct_io: bool, open_fn: OpenFn = os.open, read_fn: ReadFn = preadv_into,
                 residency_fn: ResidencyFn | None = DEFAULT_RESIDENCY_FN):
        self.path = str(path)
        self._read_fn = read_fn
        self._residency_fn = residency_fn
        self._lock = threading.Lock()
        self._fd = open_fn(self.path, os.O_RDONLY)
        self._direct_fd = -1
        if direct_io and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = open_fn(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    os.close(self._fd)
                    raise
        self._use_direct = self._direct_fd >= 0
        self._ask_residency = self._use_direct and residency_fn is not None
        self._probe_cache = self._use_direct and (self._ask_residency or _RWF_NOWAIT != 0)
        if self._use_direct and hasattr(os, "posix_fadvise"):
            # The buffered descriptor only copies pages already cached: no readahead from it.
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.num_cached_bytes = 0  # taken from the page cache by the RWF_NOWAIT probe
        self.num_direct_bytes = 0  # read with O_DIRECT
        self.num_buffered_bytes = 0  # read through the page cache, waiting for the disk if needed

    @property
    def direct_io(self) -> bool:
        """Whether uncached bytes are read with O_DIRECT (False without it or after a fallback)."""
        with self._lock:
            return self._use_direct

    def _cached_runs(self, offset: int, length: int) -> list[tuple[int, int]] | None:
        """The range's cached runs, by asking (no I/O); None when it cannot be asked (then
        `_read_cached` probes with RWF_NOWAIT)."""
        if not self._ask_residency:
            return None
        try:
            return self._residency_fn(self._fd, offset, length)
        except (OSError, ValueError):  # unmappable file or odd offset
            with self._lock:
                self._ask_residency = False
            return None

    def read_pieces(self, destination: memoryview, offset: int, piece_bytes: int) -> Iterator[memoryview]:
        """Fill `destination` (the file's bytes from `offset` on) piece by piece, yielding each piece
        once it is in, so the caller can hash it while it is still in the CPU's cache. The page
        cache is asked once for the whole range, not per piece."""
        total = len(destination)
        runs = self._cached_runs(offset, total) if self._probe_cache else None
        if runs is None:  # no answer: each piece probes (RWF_NOWAIT) or reads as configured
            for start in range(0, total, piece_bytes):
                piece = destination[start: start + piece_bytes]
                self.read_into(piece, offset + start)
                yield piece
            return
        segments = plan_segments(runs, total)
        cached = sum(min(end, total) - start for start, end in runs)
        direct = 0
        k = 0  # the first segment that may still overlap the current piece
        for start in range(0, total, piece_bytes):
            end = min(start + piece_bytes, total)
            while k < len(segments) and segments[k][1] <= start:
                k += 1
            j = k
            while j < len(segments) and segments[j][0] < end:
                seg_start, seg_end, seg_buffered = segments[j]
                lo, hi = max(start, seg_start), min(end, seg_end)
                if seg_buffered:
                    self._read_buffered(destination[lo:hi], offset + lo)
                else:
                    direct += self._read_direct(destination[lo:hi], offset + lo)
                j += 1
            yield destination[start:end]
        with self._lock:  # buffered: short holes, and direct reads a refusing filesystem sent through the cache
            self.num_cached_bytes += cached
            self.num_direct_bytes += direct
            self.num_buffered_bytes += total - cached - direct

    def _read_buffered(self, destination: memoryview, offset: int) -> None:
        """A buffered read of a range known to be cached (waits for the disk if a page was dropped
        meanwhile: still correct)."""
        done = 0
        while done < len(destination):
            n = self._read_fn(self._fd, destination[done:], offset + done, 0)
            if n == 0:
                raise TruncatedCheckpointError(f"{self.path} ended at byte {offset + done} while reading "
                                               f"[{offset}, {offset + len(destination)}): the file shrank after "
                                               f"the load started")
            done += n

    def _read_cached(self, destination: memoryview, offset: int) -> int:
        """Copy what the page cache already holds of `destination`'s range, probing with
        RWF_NOWAIT (used only where the cache cannot be asked); returns bytes copied."""
        if _RWF_NOWAIT == 0:
            return 0
        done = 0
        while done < len(destination):
            try:
                n = self._read_fn(self._fd, destination[done:], offset + done, _RWF_NOWAIT)
            except OSError as exc:
                if exc.errno == errno.EOPNOTSUPP:  # e.g. tmpfs: no cache to probe
                    with self._lock:
                        self._probe_cache = False
                elif exc.errno != errno.EAGAIN:  # EAGAIN: the next page is not cached
                    raise
                break
            if n == 0:
                break
            done += n
        return done

    def read_into(self, destination: memoryview, offset: int, *, probe: bool = True) -> None:
        """Fill `destination` with the file's bytes from `offset` on (looping over short reads).
        `probe=False`: the range is known not to be cached; skip taking a cached prefix first."""
        if probe and self._probe_cache and self._ask_residency:
            for _ in self.read_pieces(destination, offset, max(1, len(destination))):
                pass
            return
        total = len(destination)
        done = self._read_cached(destination, offset) if probe and self._probe_cache else 0
        direct = self._read_direct(destination[done:], offset + done)
        with self._lock:
            self.num_cached_bytes += done
            self.num_direct_bytes += direct
            self.num_buffered_bytes += total - done - direct

    def _read_direct(self, destination: memoryview, offset: int) -> int:
        """Read the range with O_DIRECT where it can (aligned start, a filesystem that allows it),
        else through the page cache; returns the bytes read with O_DIRECT."""
        total = len(destination)
        done = direct = 0
        while done < total:
            use_direct = self._use_direct and (offset + done) % ALIGNMENT_BYTES == 0
            try:
                n = self._read_fn(self._direct_fd if use_direct else self._fd, destination[done:], offset + done, 0)
            except OSError as exc:
                if exc.errno == errno.EINVAL and use_direct:
                    with self._lock:  # the filesystem refuses O_DIRECT reads: buffered from now on
                        self._use_direct = self._probe_cache = self._ask_residency = False
                    continue
                raise OSError(exc.errno, f"{exc.strerror} while reading bytes [{offset + done}, {offset + total}) "
                                         f"of {self.path}") from exc
            if n == 0:
                raise TruncatedCheckpointError(f"{self.path} ended at byte {offset + done} while reading "
                                               f"[{offset}, {offset + total}): the file shrank after the load started")
            done += n
            direct += n if use_direct else 0
        return direct

    def close(self) -> None:
        with self._lock:
            for fd in (self._fd, self._direct_fd):
                if fd >= 0:
                    os.close(fd)
            self._fd = self._direct_fd = -1
            self._use_direct = self._probe_cache = False
