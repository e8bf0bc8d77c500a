"""Parallel, layer-ordered, checksum-verified loading of a thaw checkpoint into host memory.

`ThawCheckpointLoader` reads every chunk of every partition, in file order, on a small thread pool
(``os.preadv``, ``O_DIRECT`` when the filesystem allows) into *one* buffer from a
`HostMemoryPool`; each partition has its own aligned region of that buffer, so a tensor is a
zero-copy view ``buffer[offset:offset + size].view(dtype).view(shape)``. Each chunk's xxh3_64 is
computed by the thread that reads it, piece by piece as the pieces land (still in cache).

Because the converter writes tensors in layer order (embedding, layers 0..N-1, final norm and
head), the chunks of layer k land before those of layer k+1; `wait_layer(k)` returns layer k's
tensors as soon as every chunk holding its bytes is resident *and verified*, so a worker can start
copying layer 0 to the device (or even computing) while later layers are still on disk
(BlitzScale's per-layer readiness; ServerlessLLM's chunked multi-threaded reads into a pool).

On a memory-backed filesystem (the DRAM tier's tmpfs) the partitions are mapped instead of read:
the tensors are read-only views of the tier's own pages, and the threads only verify (or fault in)
their chunks -- no copy, and instances of one model on a node share one copy (`loader.memory_backed`).

A partition file this loader (or an earlier one) verified, and that has not changed since, is not
hashed again (`loader.verification_record`): the hash costs as much CPU as the copy, and a warm
load pays for it at every cold start. `LoaderConfig(trust_verified=False)` re-hashes every time.

Errors are never silent: if any chunk fails (checksum mismatch, I/O error, truncation) the load
stops, and every current and later `wait_layer`/`wait_all` raises that error -- a tensor is never
returned from a load that is known to be corrupt.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from loader.format import (ALIGNMENT_BYTES, ChecksumMismatchError, CheckpointFormatError, TensorEntry, ThawIndex,
                           TruncatedCheckpointError, torch_dtype)
from loader.memory_backed import is_memory_backed, map_read_only, populate
from loader.memory_pool import HostMemoryPool
from loader.partition_reader import (DEFAULT_RESIDENCY_FN, OpenFn, PartitionReader, ReadFn, ResidencyFn,
                                     preadv_into)
from loader.verification_record import ClockNs, FileVersion, record_verified, verified_files

# Measured on the 2-vCPU dev machine kind, ~0.9 GB bf16 checkpoint, 64 MiB chunks, pre-faulted
# pool, GB/s for 1/2/4/8 threads: page cache warm 2.9/5.3/5.3/5.4 with checksums, 4.2/8.0/8.0/7.8
# without; cold (O_DIRECT) 1.1/1.29/1.23/1.23. Two threads already saturate 2 cores and the
# disk; 4 costs nothing here and leaves queue depth for faster disks (ServerlessLLM uses 4 too).
# Checksums: xxh3_64 runs at 7-7.8 GB/s per core (14.5 GB/s on 2 threads: it releases the GIL), but
# on 2 cores it competes with the copy, so verifying costs ~35% warm (8.55 -> 5.50 GB/s) and ~5%
# cold (1.33 -> 1.26 GB/s, disk-bound).
DEFAULT_NUM_THREADS = 4
# A verified chunk is read and hashed in pieces of this size, each hashed right after it lands,
# while it is still in the CPU's cache: hashing a whole 64 MiB chunk after reading it read every
# byte from DRAM twice. Measured (1.07 GB, page cache warm, pre-faulted buffer, 2 vCPUs): read then
# hash 5.7-5.9 GB/s; in 1-4 MiB pieces 8.1-8.6 GB/s, as fast as reading without checksums (8.8).
# Cold O_DIRECT reads ran at the disk's rate for pieces of 1-64 MiB alike (1.8-2.0 GB/s).
DEFAULT_PIECE_BYTES = 2 << 20

@dataclass(frozen=True)
class LoaderConfig:
    """How to read a checkpoint. Chunks are the index's checksum chunks (one read per chunk)."""

    num_threads: int = DEFAULT_NUM_THREADS
    direct_io: bool = True  # try O_DIRECT; falls back to buffered reads where the filesystem refuses it
    # Off only when the bytes are known good (e.g. just verified by another loader): without it a
    # flipped bit on disk becomes a silently wrong weight.
    verify_checksums: bool = True
    # Skip the hash for a partition file recorded as verified and unchanged since (same inode, size,
    # mtime and ctime; see `loader.verification_record`). False: hash every byte at every load.
    trust_verified: bool = True
    # Map partitions on a memory-backed filesystem (the DRAM tier's tmpfs) instead of copying them:
    # the tensors become read-only views of the tier's pages (see `loader.memory_backed`).
    map_memory_backed: bool = True
    piece_bytes: int = DEFAULT_PIECE_BYTES  # read-and-hash granularity; a multiple of 4096

    def __post_init__(self) -> None:
        valid = isinstance(self.num_threads, int) and not isinstance(self.num_threads, bool)
        if not valid or not 1 <= self.num_threads <= 256:
            raise ValueError(f"LoaderConfig.num_threads is {self.num_threads!r}; use an integer in 1..256 "
                             f"(default {DEFAULT_NUM_THREADS})")
        piece = self.piece_bytes
        if (not isinstance(piece, int) or isinstance(piece, bool) or piece < ALIGNMENT_BYTES
                or piece % ALIGNMENT_BYTES):
            raise ValueError(f"LoaderConfig.piece_bytes is {piece!r}; use a positive multiple of {ALIGNMENT_BYTES} "
                             f"(default {DEFAULT_PIECE_BYTES})")


@dataclass(frozen=True)
class LoadStats:
    """What a load did: `elapsed_s` runs from the first read issued to the last chunk verified."""

    num_bytes: int  # bytes resident so far (all partitions, padding included)
    total_bytes: int
    elapsed_s: float
    alloc_s: float  # acquiring the host buffer (near 0 when the pool had a reserved block)
    direct_io: bool  # uncached bytes of every partition were read with O_DIRECT (no buffered fallback)
    num_cached_bytes: int  # taken from the page cache (RWF_NOWAIT probe, direct_io only)
    num_direct_bytes: int  # read from disk with O_DIRECT; the rest went through the page cache
    num_threads: int
    verified: bool  # every byte's checksum was checked, by this load or (trusted) an earlier one
    mapped: bool = False  # the partitions were mapped from memory-backed files, not copied
    num_trusted_bytes: int = 0  # not hashed: their files were verified before and are unchanged since

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0


def check_partition_files(ckpt_dir: Path, index: ThawIndex) -> None:
    """Refuse a checkpoint whose partition files are missing, shorter or longer than its index says."""
    for p in index.partitions:
        path = ckpt_dir / p.file
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            raise TruncatedCheckpointError(f"{path} is missing (the index expects {p.size} bytes)") from None
        if actual < p.size:
            raise TruncatedCheckpointError(f"{path} is truncated: {actual} bytes, the index expects {p.size}; "
                                           f"copy or convert the checkpoint again")
        if actual > p.size:
            raise CheckpointFormatError(f"{path} is {actual} bytes but the index expects {p.size}: "
                                        f"the index and the partition come from different conversions")


def chunk_layers(index: ThawIndex) -> dict[tuple[int, int], tuple[int, ...]]:
    """(partition, chunk index) -> the layers with tensor bytes in that checksum chunk, sorted
    (chunks holding only padding are absent)."""
    chunk_bytes = index.chunk_bytes
    layers_of: dict[tuple[int, int], set[int]] = {}
    for t in index.tensors:
        if t.size == 0:
            continue
        for i in range(t.offset // chunk_bytes, (t.offset + t.size - 1) // chunk_bytes + 1):
            layers_of.setdefault((t.partition, i), set()).add(t.layer)
    return {key: tuple(sorted(layers)) for key, layers in layers_of.items()}


def checksum_error(ckpt_dir: Path, index: ThawIndex, partition: int, chunk_index: int,
                   actual: str) -> ChecksumMismatchError:
    """The error for chunk `chunk_index` of `partition` hashing to `actual`: names the file, the
    byte range and the tensors in it."""
    entry = index.partitions[partition]
    chunk = entry.chunks[chunk_index]
    end = chunk.offset + chunk.size
    names = index.tensors_overlapping(partition, chunk.offset, end)
    return ChecksumMismatchError(
        f"{ckpt_dir / entry.file}: chunk {chunk_index} (bytes [{chunk.offset}, {end})) has "
        f"xxh3_64 {actual}, the index says {chunk.xxh3_64}; tensors in this chunk: "
        f"{', '.join(names) if names else '(padding only)'}. The checkpoint is corrupt: convert or copy it again")


@dataclass(frozen=True)
class _Chunk:
    partition: int
    index: int  # within the partition
    file_offset: int
    buffer_offset: int
    size: int
    xxh3_64: str
    layers: tuple[int, ...]  # layers with tensor bytes in this chunk


class ThawCheckpointLoader:
    """Loads one thaw checkpoint; see the module docstring.

    Usage::

        with ThawCheckpointLoader(ckpt_dir, pool=pool) as loader:
            loader.start()                      # optional: wait_* start the load too
            embed = loader.wait_layer(-1)       # {name: tensor view}
            ...
            del embed                           # drop every view before the loader closes

    `close()` (or leaving the ``with`` block) stops the reads and returns the buffer to the pool,
    which may hand it to the next load: the tensors returned earlier are views into it and must be
    dropped (or copied elsewhere, e.g. to the device) before. `load_checkpoint` keeps the buffer
    for the life of the returned tensors instead.

    `open_fn` / `read_fn` replace ``os.open`` / ``os.preadv`` (tests use them to gate reads);
    `residency_fn` answers which bytes the page cache holds (None: probe with ``RWF_NOWAIT``);
    `clock_ns` is the wall clock the verification record compares file times with.
    """

    def __init__(self, ckpt_dir: str | Path, config: LoaderConfig | None = None, pool: HostMemoryPool | None = None,
                 *, open_fn: OpenFn = os.open, read_fn: ReadFn = preadv_into,
                 residency_fn: ResidencyFn | None = DEFAULT_RESIDENCY_FN, clock_ns: ClockNs = time.time_ns):
        self.ckpt_dir = Path(ckpt_dir)
        self.config = config or LoaderConfig()
        self.index = ThawIndex.read(self.ckpt_dir)
        self._pool = pool if pool is not None else HostMemoryPool()
        self._open_fn = open_fn
        self._read_fn = read_fn
        self._residency_fn = residency_fn
        self._clock_ns = clock_ns
        self._check_partition_files()
        # Versions seen now, before any byte is read: a write during the load changes the file's
        # version, so what is recorded afterwards can only be the bytes that were hashed.
        self._versions = {p.file: FileVersion.of(self.ckpt_dir / p.file) for p in self.index.partitions}
        self._trusted: set[int] = set()  # partitions whose hash is skipped
        if self.config.verify_checksums and self.config.trust_verified:
            trusted_files = verified_files(self.ckpt_dir, self._versions)
            self._trusted = {i for i, p in enumerate(self.index.partitions) if p.file in trusted_files}

        self._partition_bases: list[int] = []  # buffer offset of each partition's region
        base = 0
        for p in self.index.partitions:
            self._partition_bases.append(base)
            base += p.size
        self._chunks = self._plan_chunks()
        self._layer_tensors: dict[int, list[TensorEntry]] = {k: [] for k in range(-1, self.index.num_layers + 1)}
        for t in self.index.tensors:
            self._layer_tensors[t.layer].append(t)

        self._cond = threading.Condition()
        self._pending_chunks = {k: 0 for k in self._layer_tensors}  # per layer: chunks not yet resident and verified
        for chunk in self._chunks:
            for layer in chunk.layers:
                self._pending_chunks[layer] += 1
        self._num_chunks_left = len(self._chunks)
        self._bytes_done = 0
        self._error: BaseException | None = None
        self._started = self._closed = False
        self._buffer: torch.Tensor | None = None  # [total_bytes] uint8 from the pool (None when mapped)
        self._partitions: list[torch.Tensor] | None = None  # [partition size] uint8 each: copy or mapping
        self._mapped = False
        self._readers: list[PartitionReader] = []
        self._executor: ThreadPoolExecutor | None = None
        self._start_time = self._end_time = 0.0
        self._alloc_s = 0.0

    def _check_partition_files(self) -> None:
        check_partition_files(self.ckpt_dir, self.index)

    def _plan_chunks(self) -> list[_Chunk]:
        layers_of = chunk_layers(self.index)
        chunks = []
        for p_idx, p in enumerate(self.index.partitions):
            for i, c in enumerate(p.chunks):
                chunks.append(_Chunk(partition=p_idx, index=i, file_offset=c.offset,
                                     buffer_offset=self._partition_bases[p_idx] + c.offset, size=c.size,
                                     xxh3_64=c.xxh3_64, layers=layers_of.get((p_idx, i), ())))
        return chunks

    # -- reading ------------------------------------------------------------------------------

    def start(self) -> None:
        """Acquire the buffer and start reading every chunk in the background (idempotent)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("ThawCheckpointLoader.start() after close()")
            if self._started:
                return
            self._started = True
        buffer = None
        try:
            t0 = time.perf_counter()
            # Injected I/O functions (tests) mean the read path is what is being exercised.
            default_io = self._open_fn is os.open and self._read_fn is preadv_into
            if self.config.map_memory_backed and default_io and is_memory_backed(self.ckpt_dir):
                partitions = [map_read_only(self.ckpt_dir / p.file, p.size) for p in self.index.partitions]
            else:
                buffer = self._pool.acquire(self.index.total_bytes)
                partitions = [buffer[base: base + p.size]
                              for base, p in zip(self._partition_bases, self.index.partitions)]
                for p in self.index.partitions:
                    self._readers.append(PartitionReader(self.ckpt_dir / p.file, direct_io=self.config.direct_io,
                                                         open_fn=self._open_fn, read_fn=self._read_fn,
                                                         residency_fn=self._residency_fn))
            self._alloc_s = time.perf_counter() - t0
            with self._cond:  # waiters in other threads see the buffers only once they are set up
                self._buffer, self._partitions, self._mapped = buffer, partitions, buffer is None
                self._cond.notify_all()
        except BaseException as exc:
            if buffer is not None and self._buffer is None:
                self._pool.release(buffer)
            self._fail(exc)
            raise
        with self._cond:  # under the lock: a racing close() either sees the executor or stops us here
            self._start_time = time.perf_counter()
            if self._closed or not self._chunks:
                self._end_time = self._start_time
                return
            self._executor = ThreadPoolExecutor(self.config.num_threads, thread_name_prefix="thaw-loader")
            for chunk in self._chunks:  # FIFO: file order, so earlier layers land first
                self._executor.submit(self._read_chunk, chunk)

    def _read_chunk(self, chunk: _Chunk) -> None:
        with self._cond:
            if self._error is not None or self._closed:
                return
        try:
            partition = self._partitions[chunk.partition]
            destination = partition[chunk.file_offset: chunk.file_offset + chunk.size].numpy()  # [size] uint8
            verify = self.config.verify_checksums and chunk.partition not in self._trusted
            if not self._mapped:
                actual = self._read_and_hash(chunk, memoryview(destination), verify)
            elif verify:  # the bytes are there; hashing faults the page tables in
                actual = xxhash.xxh3_64_hexdigest(destination)
            else:
                populate(partition, chunk.file_offset, chunk.size)
                actual = None
            if actual is not None and actual != chunk.xxh3_64:
                raise self._checksum_error(chunk, actual)
        except BaseException as exc:
            self._fail(exc)
            return
        with self._cond:
            for layer in chunk.layers:
                self._pending_chunks[layer] -= 1
            self._bytes_done += chunk.size
            self._num_chunks_left -= 1
            finished = self._num_chunks_left == 0
            if finished:
                self._end_time = time.perf_counter()
            self._cond.notify_all()
        if finished and self.config.verify_checksums:  # after the waiters are woken: off the load's clock
            hashed = {p.file: self._versions[p.file] for i, p in enumerate(self.index.partitions)
                      if i not in self._trusted}
            if hashed:
                record_verified(self.ckpt_dir, hashed, clock_ns=self._clock_ns)

    def _read_and_hash(self, chunk: _Chunk, destination: memoryview, verify: bool) -> str | None:
        """Read `chunk` into `destination`; its xxh3_64 when verifying (piece by piece, see
        DEFAULT_PIECE_BYTES), else None."""
        reader = self._readers[chunk.partition]
        if not verify:
            reader.read_into(destination, chunk.file_offset)
            return None
        digest = xxhash.xxh3_64()  # streaming: the same digest as hashing the chunk at once
        for piece in reader.read_pieces(destination, chunk.file_offset, self.config.piece_bytes):
            digest.update(piece)
        return digest.hexdigest()

    def _checksum_error(self, chunk: _Chunk, actual: str) -> ChecksumMismatchError:
        return checksum_error(self.ckpt_dir, self.index, chunk.partition, chunk.index, actual)

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    # -- waiting ------------------------------------------------------------------------------

    def _wait(self, done, what: str, timeout_s: float | None) -> list[torch.Tensor]:
        """Wait for `done()`; returns the partition buffers (read under the lock, so a racing close()
        cannot null them)."""
        self.start()
        with self._cond:
            finished = self._cond.wait_for(
                lambda: self._error is not None or self._closed or (self._partitions is not None and done()),
                timeout=timeout_s)
            if self._error is not None:
                raise self._error
            if self._closed:
                raise RuntimeError(f"the loader was closed while waiting for {what}")
            if not finished:
                raise TimeoutError(f"{what} of {self.ckpt_dir} not resident after {timeout_s} s "
                                   f"({self._bytes_done} of {self.index.total_bytes} bytes read)")
            return self._partitions

    def _check_layer(self, layer: int) -> None:
        if layer not in self._layer_tensors:
            raise ValueError(f"layer {layer} does not exist: layers run from -1 (embedding) to "
                             f"{self.index.num_layers} (final norm and head)")

    @staticmethod
    def _view(partitions: list[torch.Tensor], t: TensorEntry) -> torch.Tensor:
        return partitions[t.partition][t.offset: t.offset + t.size].view(torch_dtype(t.dtype)).view(t.shape)  # zero-copy

    def layer_ready(self, layer: int) -> bool:
        """Whether every chunk of `layer` is resident and verified (and nothing has failed)."""
        self._check_layer(layer)
        with self._cond:
            return (self._partitions is not None and self._error is None and not self._closed
                    and self._pending_chunks[layer] == 0)

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """Block until `layer` (-1 embedding, 0..N-1 decoder layers, N final group) is resident and
        verified; returns its tensors as views into the load buffer. Raises the load's error if any
        chunk failed, TimeoutError after `timeout_s`."""
        self._check_layer(layer)
        partitions = self._wait(lambda: self._pending_chunks[layer] == 0, f"layer {layer}", timeout_s)
        return {t.name: self._view(partitions, t) for t in self._layer_tensors[layer]}

    def wait_all(self, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """Block until every chunk is resident and verified; returns all tensors, in file order."""
        partitions = self._wait(lambda: self._num_chunks_left == 0, "the checkpoint", timeout_s)
        return {t.name: self._view(partitions, t) for t in self.index.tensors}

    @property
    def stats(self) -> LoadStats:
        with self._cond:
            end = self._end_time if self._num_chunks_left == 0 else time.perf_counter()
            elapsed = end - self._start_time if self._started and self._start_time else 0.0
            return LoadStats(num_bytes=self._bytes_done, total_bytes=self.index.total_bytes, elapsed_s=elapsed,
                             alloc_s=self._alloc_s,
                             direct_io=bool(self._readers) and all(r.direct_io for r in self._readers),
                             num_cached_bytes=sum(r.num_cached_bytes for r in self._readers),
                             num_direct_bytes=sum(r.num_direct_bytes for r in self._readers),
                             num_threads=self.config.num_threads, verified=self.config.verify_checksums,
                             mapped=self._mapped,
                             num_trusted_bytes=sum(self.index.partitions[i].size for i in self._trusted))

    # -- teardown -----------------------------------------------------------------------------

    def _stop_io(self) -> None:
        """Stop reading (queued chunks are skipped), join the threads and close the files."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        for reader in self._readers:
            reader.close()

    def close(self) -> None:
        """Stop the load and return the buffer to the pool. Drop every returned tensor first.
        (A mapping is not the pool's: it lives as long as any tensor viewing it.)"""
        self._stop_io()
        self._partitions = None
        if self._buffer is not None:
            buffer, self._buffer = self._buffer, None
            self._pool.release(buffer)

    def __enter__(self) -> ThawCheckpointLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def load_checkpoint(ckpt_dir: str | Path, config: LoaderConfig | None = None,
                    pool: HostMemoryPool | None = None) -> tuple[dict[str, torch.Tensor], LoadStats]:
    """Load a whole thaw checkpoint; returns (name -> tensor, stats).

    The tensors are views into one host buffer that lives as long as any of them. With a `pool`,
    that buffer stays acquired from it (use `ThawCheckpointLoader` to give it back when done).
    """
    loader = ThawCheckpointLoader(ckpt_dir, config, pool)
    try:
        tensors = loader.wait_all()
    except BaseException:
        loader.close()
        raise
    stats = loader.stats
    loader._stop_io()
    return tensors, stats
