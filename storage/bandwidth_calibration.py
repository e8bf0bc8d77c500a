"""Measuring a node's tier bandwidths at store start, so placement can estimate load seconds.

Each probe times the path a real load takes, on the real filesystem, at a configurable size
(large enough to be meaningful in production, a few hundred KiB in tests):

- disk: a probe file written in the SSD cache directory, dropped from the page cache, then read
  back with O_DIRECT (buffered where refused) on a few threads into pre-faulted memory -- a cold
  load from the SSD tier, as the loader does it;
- DRAM: the same read from a file in the shared-memory tier -- a load from the DRAM tier;
- repository: an object uploaded under the repository's ``_probes/`` and downloaded through the
  same ranged-read path a fetch uses (skipped, None, if the repository refuses the write).

These are estimates, not promises: a busy disk or network reads slower later, which is why the
store also records the rate of every real fetch.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from storage.model_repository import ModelRepository, RepositoryError
from storage.store_report import BandwidthReport

logger = logging.getLogger(__name__)

_PAGE_BYTES = 4096
_PATTERN_BYTES = 1 << 20
_READ_CHUNK_BYTES = 16 << 20
_NUM_READ_THREADS = 4  # as the loader (loader.checkpoint_loader.DEFAULT_NUM_THREADS)


def _write_probe(path: Path, num_bytes: int) -> None:
    pattern = os.urandom(_PATTERN_BYTES)  # incompressible, so a deduplicating disk cannot cheat
    with open(path, "wb") as f:
        for offset in range(0, num_bytes, _PATTERN_BYTES):
            f.write(pattern[: min(_PATTERN_BYTES, num_bytes - offset)])
        f.flush()
        os.fsync(f.fileno())


def _open_for_read(path: Path, direct: bool) -> int:
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, os.O_RDONLY)


def measure_read_bytes_per_s(directory: Path, num_bytes: int, *, cold: bool) -> float:
    """Bytes per second reading a `num_bytes` probe file in `directory` into pre-faulted memory.

    `cold`: drop the file from the page cache and read with O_DIRECT (a disk); otherwise buffered."""
    path = directory / f".bandwidth-probe-{os.getpid()}"
    buffer = mmap.mmap(-1, num_bytes)  # page-aligned, as O_DIRECT needs
    try:
        _write_probe(path, num_bytes)
        buffer.write(bytes(num_bytes))  # fault every page now: a real load reads into a pre-faulted pool
        fd = _open_for_read(path, direct=cold)
        try:
            if cold:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            view = memoryview(buffer)
            chunks = [(off, min(_READ_CHUNK_BYTES, num_bytes - off)) for off in range(0, num_bytes, _READ_CHUNK_BYTES)]

            def read(chunk: tuple[int, int]) -> None:
                off, n = chunk
                done = 0
                while done < n:
                    got = os.preadv(fd, [view[off + done: off + n]], off + done)
                    if got == 0:
                        raise OSError(f"{path} shrank while it was being read")
                    done += got

            start = time.perf_counter()
            with ThreadPoolExecutor(_NUM_READ_THREADS) as pool:
                list(pool.map(read, chunks))
            elapsed = time.perf_counter() - start
            del view
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
        try:
            buffer.close()
        except BufferError:  # a failed read left a view alive; the mapping goes with it
            pass
    return num_bytes / max(elapsed, 1e-9)


def calibrate_bandwidth(*, ssd_dir: Path, shm_dir: Path | None, num_bytes: int,
                        repository: ModelRepository | None, repository_bytes: int, probe_id: str) -> BandwidthReport:
    """Measure what can be measured; a probe that fails is logged and reported as None."""
    disk = measure_read_bytes_per_s(ssd_dir, num_bytes, cold=True)
    dram = measure_read_bytes_per_s(shm_dir, num_bytes, cold=False) if shm_dir is not None else None
    repo = None
    if repository is not None and repository_bytes > 0:
        try:
            repo = repository.measure_download_bytes_per_s(repository_bytes, ssd_dir, probe_id)
        except (RepositoryError, OSError) as exc:
            logger.warning("repository bandwidth not measured (%s); the first fetch will measure it", exc)
    return BandwidthReport(ssd_bytes_per_s=disk, dram_bytes_per_s=dram, repository_bytes_per_s=repo,
                           measured_at=time.time())
