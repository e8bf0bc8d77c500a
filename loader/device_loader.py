"""Loading a thaw checkpoint straight into device memory, at the storage's bandwidth.

ServerlessLLM's pipeline, over the thaw format: `num_threads` reader threads take the checkpoint's
checksum chunks in file order (so layer order), read each piece (``pread``, ``O_DIRECT`` where
the filesystem allows, see `loader.partition_reader`) into a free page-locked buffer of a small
`StagingPool`, hash it as it lands (xxh3_64 per chunk, as `ThawCheckpointLoader` does), and start
an asynchronous copy into ONE device allocation, on one of a few copy streams. A retire thread
waits for each copy's completion in issue order and only then returns its buffer to the pool, so
the disk, the CPU and the link all work at once and readers wait when every buffer is in flight.
Tensors are views of the device allocation (``buffer[offset:offset + size].view(dtype)``), as the
host loader's are of its host buffer; nothing passes through pageable memory on the way.

From the DRAM tier (a memory-backed file system, `loader.memory_backed`) the staging copy can be
skipped: each piece of the read-only mapping of the tier's file is registered with the device
(``cudaHostRegister``) and copied from directly, then unregistered once its copy completed. If
registration fails the load carries on through the staging buffers; `DeviceLoadStats.source_kind`
says which path carried the bytes. Registration is opt-in (`DeviceLoaderConfig(register_memory_backed=True)`):
on an H100 it measured 5x slower than staging (pinning each piece costs more than copying it), so
by default the DRAM tier is staged like any file.

The device is injected (`loader.copy_engine.CopyEngine`): `CudaCopyEngine` on a GPU; in tests a
CPU engine that completes copies when the test says so, so ordering, back-pressure, errors and
teardown are tested deterministically without a GPU.

Per-layer readiness (`loader.LayerReadiness`): `wait_layer(k)` returns layer k's tensors once every
chunk holding its bytes is verified and its copies have completed, so an engine can start on
layer 0 while later layers are still on disk. Errors are never silent: a checksum mismatch, an
I/O error, a file that shrank or a failed copy stops the load; the threads are joined, every
staging buffer returns to the pool, and every current and later wait raises that error.
Verification records (`loader.verification_record`) are honoured as by the host loader: a
partition verified before and unchanged since is not hashed again (`trust_verified`).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from loader.checkpoint_loader import check_partition_files, checksum_error, chunk_layers
from loader.copy_engine import Completion, CopyEngine
from loader.format import ALIGNMENT_BYTES, TensorEntry, ThawIndex, torch_dtype
from loader.memory_backed import is_memory_backed, map_read_only
from loader.partition_reader import DEFAULT_RESIDENCY_FN, OpenFn, PartitionReader, ReadFn, ResidencyFn, preadv_into
from loader.staging_pool import StagingConfig, StagingPool
from loader.verification_record import ClockNs, FileVersion, record_verified, verified_files

# Readers in flight at once: each holds one staging buffer while it reads, so the pool's default
# 16 buffers leave 8 in the copy queue. Disks need a queue of several reads to reach their rate,
# and a verified piece costs one core's xxh3 (~7 GB/s) plus the read.
DEFAULT_NUM_THREADS = 16
DEFAULT_PIECE_BYTES = 2 << 20  # read-and-hash granularity inside a staging buffer (see checkpoint_loader)
SOURCE_REGISTERED = "dram-registered"  # every byte DMA'd from the DRAM tier's own (registered) pages
SOURCE_STAGED = "staged"  # through the pinned staging buffers (all or part of the bytes)


@dataclass(frozen=True)
class DeviceLoaderConfig:
    """How to read a checkpoint into device memory."""

    num_threads: int = DEFAULT_NUM_THREADS
    direct_io: bool = True  # try O_DIRECT; falls back to buffered reads where the filesystem refuses it
    verify_checksums: bool = True  # off only when the bytes are known good: a flipped bit becomes a wrong weight
    trust_verified: bool = True  # skip the hash of a partition verified before and unchanged since
    # On a memory-backed filesystem (the DRAM tier), DMA straight from the tier's pages (registered
    # with the device) instead of staging them. Off by default: measured on an H100 (bench/loader_gpu.py,
    # 3.1 GB from /dev/shm) registering piece by piece ran at 3.2 GB/s, staging at 15.5 GB/s.
    register_memory_backed: bool = False
    piece_bytes: int = DEFAULT_PIECE_BYTES  # a multiple of 4096

    def __post_init__(self) -> None:
        n = self.num_threads
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 256:
            raise ValueError(f"DeviceLoaderConfig.num_threads is {n!r}; use an integer in 1..256 "
                             f"(default {DEFAULT_NUM_THREADS})")
        piece = self.piece_bytes
        if (not isinstance(piece, int) or isinstance(piece, bool) or piece < ALIGNMENT_BYTES
                or piece % ALIGNMENT_BYTES):
            raise ValueError(f"DeviceLoaderConfig.piece_bytes is {piece!r}; use a positive multiple of "
                             f"{ALIGNMENT_BYTES} (default {DEFAULT_PIECE_BYTES})")


@dataclass(frozen=True)
class DeviceLoadStats:
    """What a load did: `elapsed_s` runs from `start()` (device allocation included) to the last
    chunk verified and copied."""

    num_bytes: int  # verified and on the device so far (padding included)
    total_bytes: int
    elapsed_s: float
    alloc_s: float  # allocating the device buffer (and mapping the DRAM tier's files)
    source_kind: str  # SOURCE_REGISTERED or SOURCE_STAGED
    num_threads: int
    num_registered_bytes: int  # copied from registered DRAM-tier pages
    num_staged_bytes: int  # copied through the staging buffers
    verified: bool  # every byte's checksum was checked, by this load or (trusted) an earlier one
    num_trusted_bytes: int  # not hashed: their files were verified before and are unchanged since
    direct_io: bool  # staged reads of uncached bytes used O_DIRECT (False without staged reads)
    device: str

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0


@dataclass(frozen=True)
class _Chunk:
    partition: int
    index: int  # within the partition
    file_offset: int
    size: int
    xxh3_64: str
    layers: tuple[int, ...]


@dataclass(frozen=True)
class _Piece:
    """One copy: `size` bytes at `file_offset` of `partition`, overlapping chunks `chunk_ids`."""

    partition: int
    file_offset: int
    device_offset: int
    size: int
    chunk_ids: tuple[int, ...]


@dataclass(frozen=True)
class _Extent:
    """Consecutive chunks of one partition read by one thread (so each chunk's hash streams in
    order), as pieces of at most a staging buffer each."""

    chunk_ids: tuple[int, ...]
    pieces: tuple[_Piece, ...]


@dataclass
class _InFlight:
    piece: _Piece
    completion: Completion
    slot: int
    registered: torch.Tensor | None  # the registered source, unregistered once the copy completed


class _ChunkHasher:
    """Hashes an extent's bytes as they stream in, chunk by chunk; calls `on_verified(chunk_id)`
    for each chunk whose hash matched and raises the mismatch error for one that did not."""

    def __init__(self, loader: DeviceLoader, chunk_ids: tuple[int, ...]):
        self._loader = loader
        self._chunk_ids = chunk_ids
        self._position = 0  # index into chunk_ids
        self._remaining = loader._chunks[chunk_ids[0]].size if chunk_ids else 0
        self._digest = xxhash.xxh3_64()

    def update(self, data: memoryview) -> None:
        loader = self._loader
        while len(data):
            chunk_id = self._chunk_ids[self._position]
            n = min(len(data), self._remaining)
            verify = chunk_id in loader._hashed_chunks
            if verify:
                self._digest.update(data[:n])
            data = data[n:]
            self._remaining -= n
            if self._remaining == 0:
                if verify:
                    actual = self._digest.hexdigest()
                    chunk = loader._chunks[chunk_id]
                    if actual != chunk.xxh3_64:
                        raise checksum_error(loader.ckpt_dir, loader.index, chunk.partition, chunk.index, actual)
                    loader._chunk_verified(chunk_id)
                    self._digest.reset()
                self._position += 1
                if self._position < len(self._chunk_ids):
                    self._remaining = loader._chunks[self._chunk_ids[self._position]].size


class DeviceLoader:
    """Loads one thaw checkpoint into device memory; see the module docstring.

    Usage::

        engine = CudaCopyEngine("cuda:0")
        with DeviceLoader(ckpt_dir, engine) as loader:
            embed = loader.wait_layer(-1)       # {name: device tensor view}, while later layers load
            tensors = loader.wait_all()

    The tensors are views of one device allocation that lives as long as any of them; `close()`
    stops a load in progress (waiting for copies in flight), joins the threads and closes the
    files. `pool` is the staging pool to use (a worker keeps one across loads; by default a new
    one with `StagingConfig()` and `engine.allocate_host`). `open_fn` / `read_fn` / `residency_fn`
    replace the file I/O (tests); injected I/O also turns the DRAM tier's registration off, since
    the read path is what is then exercised. `clock_ns` is the verification record's clock.
    """

    def __init__(self, ckpt_dir: str | Path, engine: CopyEngine, config: DeviceLoaderConfig | None = None,
                 pool: StagingPool | None = None, *, open_fn: OpenFn = os.open, read_fn: ReadFn = preadv_into,
                 residency_fn: ResidencyFn | None = DEFAULT_RESIDENCY_FN, clock_ns: ClockNs = time.time_ns):
        self.ckpt_dir = Path(ckpt_dir)
        self.engine = engine
        self.config = config or DeviceLoaderConfig()
        self.index = ThawIndex.read(self.ckpt_dir)
        self.pool = pool if pool is not None else StagingPool(StagingConfig(), engine.allocate_host)
        self._open_fn, self._read_fn, self._residency_fn, self._clock_ns = open_fn, read_fn, residency_fn, clock_ns
        check_partition_files(self.ckpt_dir, self.index)
        # Versions before any byte is read: what is recorded afterwards can only be the bytes hashed.
        self._versions = {p.file: FileVersion.of(self.ckpt_dir / p.file) for p in self.index.partitions}
        self._trusted: set[int] = set()
        if self.config.verify_checksums and self.config.trust_verified:
            trusted_files = verified_files(self.ckpt_dir, self._versions)
            self._trusted = {i for i, p in enumerate(self.index.partitions) if p.file in trusted_files}

        self._partition_bases: list[int] = []  # device offset of each partition
        base = 0
        for p in self.index.partitions:
            self._partition_bases.append(base)
            base += p.size
        layers_of = chunk_layers(self.index)
        self._chunks = [_Chunk(partition=p_idx, index=i, file_offset=c.offset, size=c.size, xxh3_64=c.xxh3_64,
                               layers=layers_of.get((p_idx, i), ()))
                        for p_idx, p in enumerate(self.index.partitions) for i, c in enumerate(p.chunks)]
        self._hashed_chunks = {i for i, c in enumerate(self._chunks)
                               if self.config.verify_checksums and c.partition not in self._trusted}
        self._extents = self._plan_extents()
        self._layer_tensors: dict[int, list[TensorEntry]] = {k: [] for k in range(-1, self.index.num_layers + 1)}
        for t in self.index.tensors:
            self._layer_tensors[t.layer].append(t)

        self._cond = threading.Condition()
        self._stop = threading.Event()  # set on failure or close; read without locks (see StagingPool.acquire)
        self._pending_chunks = {k: 0 for k in self._layer_tensors}  # per layer: chunks not yet verified and copied
        for chunk in self._chunks:
            for layer in chunk.layers:
                self._pending_chunks[layer] += 1
        self._pending_pieces = [0] * len(self._chunks)  # per chunk: copies not yet completed
        for extent in self._extents:
            for piece in extent.pieces:
                for chunk_id in piece.chunk_ids:
                    self._pending_pieces[chunk_id] += 1
        self._verified = [i not in self._hashed_chunks for i in range(len(self._chunks))]
        self._num_chunks_left = len(self._chunks)
        self._bytes_done = self._registered_bytes = self._staged_bytes = 0
        self._error: BaseException | None = None
        self._started = self._closed = False
        self._registration_failed = False
        self._next_extent = 0
        self._in_flight: deque[_InFlight] = deque()
        self._num_readers_running = 0
        self._threads: list[threading.Thread] = []
        self._device_buffer: torch.Tensor | None = None  # [total_bytes] uint8 on the device
        self._mapped: list[torch.Tensor] | None = None  # the DRAM tier's partitions, mapped read-only
        self._readers: list[PartitionReader] = []
        self._start_time = self._end_time = self._alloc_s = 0.0

    def _plan_extents(self) -> list[_Extent]:
        """Chunks in file order, packed into extents of at most one staging buffer, or split into
        buffer-sized pieces when a chunk is larger than a buffer."""
        limit = self.pool.config.buffer_bytes
        extents: list[_Extent] = []
        group: list[int] = []  # consecutive chunks of one partition, group_bytes in all

        def flush() -> None:
            if group:
                first, last = self._chunks[group[0]], self._chunks[group[-1]]
                start, end = first.file_offset, last.file_offset + last.size
                extents.append(_Extent(tuple(group), (self._piece(first.partition, start, end - start),)))
                group.clear()

        group_bytes = 0
        for chunk_id, chunk in enumerate(self._chunks):
            if group and (self._chunks[group[0]].partition != chunk.partition or group_bytes + chunk.size > limit):
                flush()
                group_bytes = 0
            if chunk.size <= limit:
                group.append(chunk_id)
                group_bytes += chunk.size
                continue
            flush()
            pieces = tuple(self._piece(chunk.partition, offset, min(limit, chunk.file_offset + chunk.size - offset))
                           for offset in range(chunk.file_offset, chunk.file_offset + chunk.size, limit))
            extents.append(_Extent((chunk_id,), pieces))
        flush()
        return extents

    def _piece(self, partition: int, file_offset: int, size: int) -> _Piece:
        chunk_bytes = self.index.chunk_bytes
        first = sum(len(p.chunks) for p in self.index.partitions[:partition])  # global id of the partition's chunk 0
        ids = tuple(range(first + file_offset // chunk_bytes, first + (file_offset + size - 1) // chunk_bytes + 1))
        return _Piece(partition=partition, file_offset=file_offset,
                      device_offset=self._partition_bases[partition] + file_offset, size=size, chunk_ids=ids)

    # -- the pipeline ---------------------------------------------------------------------------

    def start(self) -> None:
        """Allocate the device buffer and start the readers and the retire thread (idempotent)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("DeviceLoader.start() after close()")
            if self._started:
                return
            self._started = True
            self._start_time = time.perf_counter()
        readers: list[PartitionReader] = []
        try:
            device_buffer = self.engine.allocate_device(self.index.total_bytes)  # [total_bytes] uint8
            default_io = self._open_fn is os.open and self._read_fn is preadv_into
            mapped = None
            if self.config.register_memory_backed and default_io and is_memory_backed(self.ckpt_dir):
                mapped = [map_read_only(self.ckpt_dir / p.file, p.size) for p in self.index.partitions]
            for p in self.index.partitions:
                readers.append(PartitionReader(self.ckpt_dir / p.file, direct_io=self.config.direct_io,
                                               open_fn=self._open_fn, read_fn=self._read_fn,
                                               residency_fn=self._residency_fn))
        except BaseException as exc:
            for reader in readers:
                reader.close()
            self._fail(exc)
            raise
        num_readers = min(self.config.num_threads, len(self._extents))
        with self._cond:
            self._device_buffer, self._mapped, self._readers = device_buffer, mapped, readers
            self._alloc_s = time.perf_counter() - self._start_time
            if not self._chunks:
                self._end_time = time.perf_counter()
            self._num_readers_running = num_readers
            self._threads = [threading.Thread(target=self._read_extents, name=f"thaw-device-reader-{i}", daemon=True)
                             for i in range(num_readers)]
            self._threads.append(threading.Thread(target=self._retire, name="thaw-device-retire", daemon=True))
            self._cond.notify_all()
        for thread in self._threads:
            thread.start()

    def _read_extents(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stop.is_set() or self._next_extent == len(self._extents):
                        return
                    extent = self._extents[self._next_extent]
                    self._next_extent += 1
                self._load_extent(extent)
        except BaseException as exc:
            self._fail(exc)
        finally:
            with self._cond:
                self._num_readers_running -= 1
                self._cond.notify_all()

    def _load_extent(self, extent: _Extent) -> None:
        hasher = _ChunkHasher(self, extent.chunk_ids)
        for piece in extent.pieces:
            slot = self.pool.acquire(self._stop.is_set)
            if slot is None:
                return  # stopping
            handed_over = False
            try:
                destination = self._device_buffer[piece.device_offset: piece.device_offset + piece.size]
                source = self._registered_source(piece)
                if source is not None:  # DMA from the DRAM tier's pages; hash them meanwhile
                    try:
                        completion = self.engine.copy_async(destination, source)
                    except BaseException:
                        self.engine.unregister_host(source)
                        raise
                    self._hand_over(_InFlight(piece, completion, slot, source))
                    handed_over = True
                    hasher.update(memoryview(source.numpy()))
                    continue
                staging = self.pool.buffer(slot)[: piece.size]  # [size] uint8, pinned
                view = memoryview(staging.numpy())
                reader = self._readers[piece.partition]
                if any(c in self._hashed_chunks for c in piece.chunk_ids):
                    for part in reader.read_pieces(view, piece.file_offset, self.config.piece_bytes):
                        hasher.update(part)
                else:
                    reader.read_into(view, piece.file_offset)
                    hasher.update(view)  # only advances past the trusted chunks
                if self._stop.is_set():
                    return  # closed or failed while reading: issue nothing more
                self._hand_over(_InFlight(piece, self.engine.copy_async(destination, staging), slot, None))
                handed_over = True
            finally:
                if not handed_over:
                    self.pool.release(slot)

    def _registered_source(self, piece: _Piece) -> torch.Tensor | None:
        """The piece's DRAM-tier pages, registered with the device; None to stage it instead."""
        if self._mapped is None or self._registration_failed:
            return None
        source = self._mapped[piece.partition][piece.file_offset: piece.file_offset + piece.size]  # [size] uint8
        if self.engine.register_host(source):
            return source
        self._registration_failed = True  # e.g. no read-only registration on this system: stage from now on
        return None

    def _hand_over(self, entry: _InFlight) -> None:
        with self._cond:
            self._in_flight.append(entry)
            if entry.registered is not None:
                self._registered_bytes += entry.piece.size
            else:
                self._staged_bytes += entry.piece.size
            self._cond.notify_all()

    def _retire(self) -> None:
        """Wait for each copy in issue order; then its buffer goes back to the pool and its chunks
        advance. Runs until the readers are gone and nothing is in flight, even after a failure:
        a buffer is never reused while a copy may still read it."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._in_flight or self._num_readers_running == 0)
                if not self._in_flight:
                    break
                entry = self._in_flight.popleft()
            copied = False
            try:
                entry.completion.wait()
                copied = True
            except BaseException as exc:
                self._fail(exc)
            try:
                if entry.registered is not None:
                    self.engine.unregister_host(entry.registered)
            except BaseException as exc:
                self._fail(exc)
            finally:
                self.pool.release(entry.slot)
            if copied:
                with self._cond:
                    for chunk_id in entry.piece.chunk_ids:
                        self._pending_pieces[chunk_id] -= 1
                        self._chunk_progress(chunk_id)
        with self._cond:
            record = self._num_chunks_left == 0 and self._error is None and self.config.verify_checksums
        if record:  # off the load's clock: the waiters were woken when the last chunk landed
            hashed = {p.file: self._versions[p.file] for i, p in enumerate(self.index.partitions)
                      if i not in self._trusted}
            if hashed:
                record_verified(self.ckpt_dir, hashed, clock_ns=self._clock_ns)

    def _chunk_verified(self, chunk_id: int) -> None:
        with self._cond:
            self._verified[chunk_id] = True
            self._chunk_progress(chunk_id)

    def _chunk_progress(self, chunk_id: int) -> None:
        """Under the lock: a chunk whose hash matched and whose copies all completed is done."""
        if not self._verified[chunk_id] or self._pending_pieces[chunk_id] != 0:
            return
        self._pending_pieces[chunk_id] = -1  # counted once
        chunk = self._chunks[chunk_id]
        for layer in chunk.layers:
            self._pending_chunks[layer] -= 1
        self._bytes_done += chunk.size
        self._num_chunks_left -= 1
        if self._num_chunks_left == 0:
            self._end_time = time.perf_counter()
        self._cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._stop.set()
            self._cond.notify_all()
        self.pool.wake()

    # -- waiting --------------------------------------------------------------------------------

    def _wait(self, done, what: str, timeout_s: float | None) -> torch.Tensor:
        """Wait for `done()`; returns the device buffer. After a failure, first waits for the
        pipeline to stop (threads joined, buffers back in the pool), then raises the error."""
        with self._cond:
            started = self._started
        if not started:
            self.start()
        with self._cond:
            finished = self._cond.wait_for(
                lambda: self._error is not None or self._closed or (self._device_buffer is not None and done()),
                timeout=timeout_s)
            error, closed, buffer = self._error, self._closed, self._device_buffer
        if error is not None:
            self._join()
            raise error
        if closed:
            raise RuntimeError(f"the loader was closed while waiting for {what}")
        if not finished:
            raise TimeoutError(f"{what} of {self.ckpt_dir} not on the device after {timeout_s} s "
                               f"({self._bytes_done} of {self.index.total_bytes} bytes)")
        return buffer

    def _check_layer(self, layer: int) -> None:
        if layer not in self._layer_tensors:
            raise ValueError(f"layer {layer} does not exist: layers run from -1 (embedding) to "
                             f"{self.index.num_layers} (final norm and head)")

    def _view(self, buffer: torch.Tensor, t: TensorEntry) -> torch.Tensor:
        start = self._partition_bases[t.partition] + t.offset
        return buffer[start: start + t.size].view(torch_dtype(t.dtype)).view(t.shape)  # zero-copy

    def layer_ready(self, layer: int) -> bool:
        """Whether every chunk of `layer` is verified and on the device (and nothing has failed)."""
        self._check_layer(layer)
        with self._cond:
            return (self._device_buffer is not None and self._error is None and not self._closed
                    and self._pending_chunks[layer] == 0)

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """Block until `layer` (-1 embedding, 0..N-1 decoder layers, N final group) is verified and
        on the device; its tensors as views of the device buffer."""
        self._check_layer(layer)
        buffer = self._wait(lambda: self._pending_chunks[layer] == 0, f"layer {layer}", timeout_s)
        return {t.name: self._view(buffer, t) for t in self._layer_tensors[layer]}

    def wait_all(self, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """Block until every chunk is verified and on the device; all tensors, in file order."""
        buffer = self._wait(lambda: self._num_chunks_left == 0, "the checkpoint", timeout_s)
        return {t.name: self._view(buffer, t) for t in self.index.tensors}

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    @property
    def num_live_threads(self) -> int:
        """Reader and retire threads still running (0 once a load finished, failed or was closed)."""
        return sum(t.is_alive() for t in self._threads)

    @property
    def stats(self) -> DeviceLoadStats:
        with self._cond:
            end = self._end_time if self._num_chunks_left == 0 else time.perf_counter()
            elapsed = end - self._start_time if self._started else 0.0
            registered_all = self._registered_bytes > 0 and self._staged_bytes == 0
            return DeviceLoadStats(
                num_bytes=self._bytes_done, total_bytes=self.index.total_bytes, elapsed_s=elapsed,
                alloc_s=self._alloc_s, source_kind=SOURCE_REGISTERED if registered_all else SOURCE_STAGED,
                num_threads=self.config.num_threads, num_registered_bytes=self._registered_bytes,
                num_staged_bytes=self._staged_bytes, verified=self.config.verify_checksums,
                num_trusted_bytes=sum(self.index.partitions[i].size for i in self._trusted),
                direct_io=self._staged_bytes > 0 and all(r.direct_io for r in self._readers),
                device=str(self.engine.device))

    # -- teardown -------------------------------------------------------------------------------

    def _join(self) -> None:
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def close(self) -> None:
        """Stop the load (copies in flight are waited for), join the threads, close the files.
        Tensors handed out earlier stay valid: they hold the device buffer."""
        with self._cond:
            self._closed = True
            self._stop.set()
            self._cond.notify_all()
        self.pool.wake()
        self._join()
        for reader in self._readers:
            reader.close()
        self._mapped = None
        self._device_buffer = None

    def __enter__(self) -> DeviceLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def load_to_device(ckpt_dir: str | Path, engine: CopyEngine, config: DeviceLoaderConfig | None = None,
                   pool: StagingPool | None = None) -> tuple[dict[str, torch.Tensor], DeviceLoadStats]:
    """Load a whole thaw checkpoint into `engine`'s device; returns (name -> device tensor, stats)."""
    with DeviceLoader(ckpt_dir, engine, config, pool) as loader:
        tensors = loader.wait_all()
        stats = loader.stats
    return tensors, stats
