"""DeviceLoader: exact tensors, file-order pieces, back-pressure, per-layer readiness, errors, teardown.

The CPU tests inject `CpuEngine`, a copy engine whose "device" is CPU memory and whose copies
happen only when they complete -- at once, or when the test releases them (``hold=True``). A
staging buffer reused before its copy completed would therefore corrupt a tensor, and the tests
control exactly how many copies are in flight. The CUDA tests (``-m cuda``) load onto a real GPU.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import pytest
import torch

from loader import (ChecksumMismatchError, DeviceLoader, DeviceLoaderConfig, LayerReadiness, StagingConfig, StagingPool,
                    ThawIndex, TruncatedCheckpointError, convert_checkpoint, load_to_device)
from loader.memory_backed import is_memory_backed
from loader.partition_reader import preadv_into
from loader.verification_record import SETTLE_NS
from tests.loader.hf_checkpoint_builder import llama_tensors, write_hf_checkpoint

WAIT_S = 30  # a guard so a bug fails the test instead of hanging it; never reached when correct
PAGE = 4096
SHM = Path("/dev/shm")
needs_shm = pytest.mark.skipif(not (SHM.is_dir() and is_memory_backed(SHM)), reason="no tmpfs at /dev/shm")


def wait_until(predicate, what):
    """Poll `predicate` (another thread's progress) until it holds; fail after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def later():
    """A clock past the settling time: the files the test just wrote count as long unchanged."""
    return time.time_ns() + 2 * SETTLE_NS


class HeldCopy:
    """One copy in flight: the bytes move only when it completes."""

    def __init__(self, destination, source):
        self.destination, self.source = destination, source
        self._done = threading.Event()
        self._error = None

    def complete(self, error=None):
        if error is None:
            self.destination.copy_(self.source)
        self._error = error
        self._done.set()

    def wait(self):
        if not self._done.wait(WAIT_S):
            raise TimeoutError("the test never completed this copy")
        if self._error is not None:
            raise self._error


class CpuEngine:
    """A copy engine into CPU memory; see the module docstring. `fail_copy`: the copy with that
    issue number fails ("issue": copy_async raises; "completion": its wait raises)."""

    def __init__(self, *, hold=False, can_register=True, fail_copy=None, fail_on="completion"):
        self.device = torch.device("cpu")
        self.can_register = can_register
        self.fail_copy, self.fail_on = fail_copy, fail_on
        self._lock = threading.Lock()
        self._hold = hold
        self._pending = deque()
        self.issued = []  # (device offset, size) per copy, in issue order
        self.registered, self.unregistered = [], []  # data_ptr of each range
        self.num_register_calls = 0
        self.num_host_allocations = 0
        self.device_buffer = None

    def allocate_device(self, num_bytes):
        self.device_buffer = torch.zeros(num_bytes, dtype=torch.uint8)
        return self.device_buffer

    def allocate_host(self, num_bytes):
        with self._lock:
            self.num_host_allocations += 1
        return torch.empty(num_bytes, dtype=torch.uint8)

    def register_host(self, tensor):
        with self._lock:
            self.num_register_calls += 1
            if self.can_register:
                self.registered.append(tensor.data_ptr())
        return self.can_register

    def unregister_host(self, tensor):
        with self._lock:
            self.unregistered.append(tensor.data_ptr())

    def copy_async(self, destination, source):
        copy = HeldCopy(destination, source)
        with self._lock:
            number = len(self.issued)
            if number == self.fail_copy and self.fail_on == "issue":
                raise RuntimeError(f"copy {number} could not be issued")
            self.issued.append((destination.data_ptr() - self.device_buffer.data_ptr(), destination.numel()))
            error = RuntimeError(f"copy {number} failed on the device") if number == self.fail_copy else None
            if self._hold:
                self._pending.append((copy, error))
                return copy
        copy.complete(error)
        return copy

    @property
    def num_issued(self):
        with self._lock:
            return len(self.issued)

    def release(self, count):
        """Complete the `count` oldest held copies."""
        with self._lock:
            released = [self._pending.popleft() for _ in range(count)]
        for copy, error in released:
            copy.complete(error)

    def release_all(self):
        """Complete every held copy and stop holding new ones."""
        with self._lock:
            self._hold = False
            released, self._pending = list(self._pending), deque()
        for copy, error in released:
            copy.complete(error)


def _convert(tmp_path, source, out_dir=None, **kwargs):
    hf = write_hf_checkpoint(tmp_path / "hf", source)
    out = Path(out_dir) if out_dir is not None else tmp_path / "thaw"
    convert_checkpoint(hf, out, progress=False, **kwargs)
    return out


def _pool(engine, num_buffers=4, buffer_bytes=PAGE):
    return StagingPool(StagingConfig(num_buffers=num_buffers, buffer_bytes=buffer_bytes), engine.allocate_host)


def _assert_identical(loaded, expected):
    assert list(loaded) != [] and sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name].cpu(), tensor), name


def _flip_byte(ckpt, tensor_name, byte_in_tensor):
    index = ThawIndex.read(ckpt)
    entry = next(t for t in index.tensors if t.name == tensor_name)
    path = ckpt / index.partitions[entry.partition].file
    position = entry.offset + byte_in_tensor
    with open(path, "r+b") as f:
        f.seek(position)
        value = f.read(1)[0]
        f.seek(position)
        f.write(bytes([value ^ 0x40]))
    return path, position


@pytest.fixture()
def source():
    return llama_tensors(2, torch.bfloat16, seed=5)


# ---- exact values and order ---------------------------------------------------------------------

@pytest.mark.parametrize("chunk_bytes, buffer_bytes", [(PAGE, PAGE), (PAGE, 4 * PAGE), (4 * PAGE, PAGE)])
@pytest.mark.parametrize("num_threads", [1, 3])
def test_every_tensor_equals_the_checkpoint(tmp_path, source, chunk_bytes, buffer_bytes, num_threads):
    ckpt = _convert(tmp_path, source, chunk_bytes=chunk_bytes, partition_bytes=64 << 10)
    engine = CpuEngine()
    config = DeviceLoaderConfig(num_threads=num_threads, piece_bytes=PAGE)
    with DeviceLoader(ckpt, engine, config, _pool(engine, 3, buffer_bytes)) as loader:
        tensors = loader.wait_all(timeout_s=WAIT_S)
        stats = loader.stats
    _assert_identical(tensors, source)
    assert len(ThawIndex.read(ckpt).partitions) == 3
    # Views of the one device allocation, not copies.
    assert {t.untyped_storage().data_ptr() for t in tensors.values()} == {engine.device_buffer.data_ptr()}
    assert (stats.num_bytes, stats.total_bytes, stats.num_staged_bytes) == (143360, 143360, 143360)
    assert (stats.source_kind, stats.num_registered_bytes, stats.num_threads) == ("staged", 0, num_threads)
    assert stats.verified is True and stats.num_trusted_bytes == 0
    assert sum(size for _, size in engine.issued) == 143360


def test_copies_are_issued_in_file_order_in_buffer_sized_pieces(tmp_path, source):
    ckpt = _convert(tmp_path, source, chunk_bytes=PAGE)
    engine = CpuEngine()
    with DeviceLoader(ckpt, engine, DeviceLoaderConfig(num_threads=1), _pool(engine, 2, 2 * PAGE)) as loader:
        loader.wait_all(timeout_s=WAIT_S)
    # 143360 bytes = 35 chunks of 4096: two chunks per 8192-byte staging buffer, the last one alone.
    assert engine.issued == [(i * 8192, 8192) for i in range(17)] + [(139264, 4096)]


def test_a_chunk_larger_than_a_buffer_is_copied_in_pieces_and_hashed_across_them(tmp_path, source):
    ckpt = _convert(tmp_path, source, chunk_bytes=4 * PAGE)
    engine = CpuEngine()
    with DeviceLoader(ckpt, engine, DeviceLoaderConfig(num_threads=1), _pool(engine, 2, PAGE)) as loader:
        _assert_identical(loader.wait_all(timeout_s=WAIT_S), source)
    assert engine.issued == [(i * PAGE, PAGE) for i in range(35)]
    partition = ckpt / "partition_000.bin"
    with open(partition, "r+b") as f:  # a byte in the third piece of the second chunk
        f.seek(4 * PAGE + 2 * PAGE + 17)
        byte = f.read(1)[0]
        f.seek(4 * PAGE + 2 * PAGE + 17)
        f.write(bytes([byte ^ 1]))
    with pytest.raises(ChecksumMismatchError, match=r"partition_000.bin: chunk 1 \(bytes \[16384, 32768\)\)"):
        load_to_device(ckpt, CpuEngine(), DeviceLoaderConfig(num_threads=1), _pool(engine, 2, PAGE))


def test_load_to_device_returns_the_tensors_and_stats(tmp_path, source):
    ckpt = _convert(tmp_path, source)
    engine = CpuEngine()
    with DeviceLoader(ckpt, engine) as loader:
        assert isinstance(loader, LayerReadiness)  # the interface the engine's layer gate takes
    tensors, stats = load_to_device(ckpt, engine, pool=_pool(engine))
    _assert_identical(tensors, source)
    assert stats.num_bytes == stats.total_bytes == 143360
    assert stats.device == "cpu"
    assert stats.num_threads == DeviceLoaderConfig().num_threads


# ---- back-pressure and readiness ----------------------------------------------------------------

def test_readers_wait_for_a_free_buffer_and_reuse_it_only_after_its_copy_completed(tmp_path, source):
    ckpt = _convert(tmp_path, source, chunk_bytes=PAGE)
    engine = CpuEngine(hold=True)
    pool = _pool(engine, num_buffers=2)
    loader = DeviceLoader(ckpt, engine, DeviceLoaderConfig(num_threads=2), pool)
    try:
        loader.start()
        wait_until(lambda: pool.num_waiting == 2, "both readers to wait for a buffer")
        assert sorted(engine.issued) == [(0, PAGE), (PAGE, PAGE)]  # two buffers, two copies in flight
        assert pool.num_free == 0
        assert loader.stats.num_bytes == 0 and not loader.layer_ready(-1)
        engine.release(1)  # one copy completes: its buffer (and only it) goes back to a reader
        wait_until(lambda: engine.num_issued == 3 and pool.num_waiting == 2, "the third copy")
        assert engine.num_issued == 3 and pool.num_free == 0
        engine.release_all()
        # Each copy moved its bytes only at completion: a buffer refilled early would show here.
        _assert_identical(loader.wait_all(timeout_s=WAIT_S), source)
        assert engine.num_host_allocations == 2
    finally:
        engine.release_all()
        loader.close()
    assert pool.num_free == 2 and loader.num_live_threads == 0


def test_a_layer_is_ready_once_its_copies_completed(tmp_path, source):
    ckpt = _convert(tmp_path, source, chunk_bytes=PAGE)
    index = ThawIndex.read(ckpt)
    embedding_chunks = -(-index.tensors_in_layer(-1)[0].size // PAGE)
    assert embedding_chunks == 3
    engine = CpuEngine(hold=True)
    loader = DeviceLoader(ckpt, engine, DeviceLoaderConfig(num_threads=1), _pool(engine, num_buffers=64))
    try:
        loader.start()
        wait_until(lambda: engine.num_issued == 35, "every copy to be issued")  # read and verified, none copied
        assert [loader.layer_ready(k) for k in (-1, 0, 1, 2)] == [False] * 4
        engine.release(embedding_chunks)
        wait_until(lambda: loader.layer_ready(-1), "the embedding")
        assert [loader.layer_ready(k) for k in (-1, 0, 1, 2)] == [True, False, False, False]
        assert loader.stats.num_bytes == 3 * PAGE
        embed = loader.wait_layer(-1, timeout_s=WAIT_S)
        assert torch.equal(embed["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
        with pytest.raises(TimeoutError, match="layer 0 of .* not on the device after 0 s"):
            loader.wait_layer(0, timeout_s=0)
        with pytest.raises(ValueError, match="layer 3 does not exist: layers run from -1 .* to 2"):
            loader.wait_layer(3)
        engine.release_all()
        _assert_identical(loader.wait_all(timeout_s=WAIT_S), source)
        assert [loader.layer_ready(k) for k in (-1, 0, 1, 2)] == [True] * 4
    finally:
        engine.release_all()
        loader.close()


# ---- errors -------------------------------------------------------------------------------------

def _assert_stopped(loader, pool, error_type):
    """The load is over: every wait raises, no layer is ready, buffers are back, threads are gone."""
    for layer in (-1, 0, 2):
        with pytest.raises(error_type):
            loader.wait_layer(layer, timeout_s=WAIT_S)
        assert loader.layer_ready(layer) is False
    assert pool.num_free == pool.config.num_buffers
    assert loader.num_live_threads == 0


@pytest.mark.parametrize("on_shm", [False, pytest.param(True, marks=needs_shm)])
def test_checksum_mismatch_stops_the_load_and_names_file_chunk_and_tensor(tmp_path, source, on_shm):
    name = "model.layers.1.mlp.down_proj.weight"
    with tempfile.TemporaryDirectory(dir=SHM if on_shm else tmp_path) as where:
        ckpt = _convert(tmp_path, source, Path(where) / "thaw", chunk_bytes=PAGE)
        path, position = _flip_byte(ckpt, name, 5000)
        chunk = position // PAGE
        engine = CpuEngine()
        pool = _pool(engine)
        loader = DeviceLoader(ckpt, engine, DeviceLoaderConfig(num_threads=2, register_memory_backed=True), pool)
        with pytest.raises(ChecksumMismatchError) as err:
            loader.wait_all(timeout_s=WAIT_S)
        message = str(err.value)
        expected_hash = ThawIndex.read(ckpt).partitions[0].chunks[chunk].xxh3_64
        assert message.startswith(f"{path}: chunk {chunk} (bytes [{chunk * PAGE}, {chunk * PAGE + PAGE})) has xxh3_64 ")
        assert message.endswith(f", the index says {expected_hash}; tensors in this chunk: {name}. "
                                f"The checkpoint is corrupt: convert or copy it again")
        _assert_stopped(loader, pool, ChecksumMismatchError)
        assert loader.stats.source_kind == ("dram-registered" if on_shm else "staged")
        assert sorted(engine.registered) == sorted(engine.unregistered)  # every registered range undone
        loader.close()


class FailingReads:
    """Reads at or beyond `offset` fail with `error` (an I/O error, as a failing disk gives)."""

    def __init__(self, offset):
        self.offset = offset

    def __call__(self, fd, destination, offset, flags=0):
        if offset >= self.offset:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return preadv_into(fd, destination, offset, flags)


def test_io_error_stops_the_load(tmp_path, source):
    ckpt = _convert(tmp_path, source, chunk_bytes=PAGE)
    engine = CpuEngine()
    pool = _pool(engine)
    config = DeviceLoaderConfig(num_threads=1, direct_io=False)
    loader = DeviceLoader(ckpt, engine, config, pool, read_fn=FailingReads(5 * PAGE))
    with pytest.raises(OSError) as err:
        loader.wait_all(timeout_s=WAIT_S)
    assert str(err.value) == (f"[Errno {errno.EIO}] {os.strerror(errno.EIO)} while reading bytes [20480, 24576) "
                              f"of {ckpt / 'partition_000.bin'}")
    assert engine.issued == [(i * PAGE, PAGE) for i in range(5)]
    _assert_stopped(loader, pool, OSError)
    loader.close()


def test_a_truncated_file_is_refused_before_or_during_the_load(tmp_path, source):
    ckpt = _convert(tmp_path, source, chunk_bytes=PAGE)
    path = ckpt / "partition_000.bin"
    size = os.path.getsize(path)
    engine = CpuEngine()
    pool = _pool(engine)
    loader = DeviceLoader(ckpt, engine, DeviceLoaderConfig(num_threads=1, direct_io=False), pool)
    os.truncate(path, size - 2 * PAGE)  # after the loader checked the sizes
    with pytest.raises(TruncatedCheckpointError, match=f"{path} ended at byte {size - 2 * PAGE} while reading"):
        loader.wait_all(timeout_s=WAIT_S)
    _assert_stopped(loader, pool, TruncatedCheckpointError)
    loader.close()
    with pytest.raises(TruncatedCheckpointError) as err:
        DeviceLoader(ckpt, engine)
    assert str(err.value) == (f"{path} is truncated: {size - 2 * PAGE} bytes, the index expects {size}; "
                              f"copy or convert the checkpoint again")


@pytest.mark.parametrize("fail_on", ["issue", "completion"])
def test_a_failed_copy_stops_the_load(tmp_path, source, fail_on):
    ckpt = _convert(tmp_path, source, chunk_bytes=PAGE)
    engine = CpuEngine(fail_copy=3, fail_on=fail_on)
    pool = _pool(engine)
    loader = DeviceLoader(ckpt, engine, DeviceLoaderConfig(num_threads=2), pool)
    expected = "copy 3 could not be issued" if fail_on == "issue" else "copy 3 failed on the device"
    with pytest.raises(RuntimeError, match=expected):
        loader.wait_all(timeout_s=WAIT_S)
    _assert_stopped(loader, pool, RuntimeError)
    loader.close()


def test_a_failed_device_allocation_fails_every_wait(tmp_path, source):
    ckpt = _convert(tmp_path, source)

    class NoMemory(CpuEngine):
        def allocate_device(self, num_bytes):
            raise RuntimeError(f"out of device memory allocating {num_bytes} bytes")

    engine = NoMemory()
    pool = _pool(engine)
    loader = DeviceLoader(ckpt, engine, pool=pool)
    with pytest.raises(RuntimeError, match="out of device memory allocating 143360 bytes"):
        loader.wait_all(timeout_s=WAIT_S)
    _assert_stopped(loader, pool, RuntimeError)
    assert engine.issued == []
    loader.close()


class GatedReads:
    """Reads at or beyond `gate_offset` block until `open_gate` is set."""

    def __init__(self, gate_offset):
        self.gate_offset = gate_offset
        self.open_gate = threading.Event()
        self.reached_gate = threading.Event()

    def __call__(self, fd, destination, offset, flags=0):
        if offset >= self.gate_offset:
            self.reached_gate.set()
            if not self.open_gate.wait(WAIT_S):
                raise TimeoutError("test gate never opened")
        return preadv_into(fd, destination, offset, flags)


def test_close_mid_load_stops_the_readers_and_returns_every_buffer(tmp_path, source):
    ckpt = _convert(tmp_path, source, chunk_bytes=PAGE)
    engine = CpuEngine()
    pool = _pool(engine)
    gate = GatedReads(5 * PAGE)
    loader = DeviceLoader(ckpt, engine, DeviceLoaderConfig(num_threads=1, direct_io=False), pool, read_fn=gate)
    closer = threading.Thread(target=loader.close)
    try:
        loader.start()
        assert gate.reached_gate.wait(WAIT_S)  # the reader holds a buffer, reading the sixth chunk
        closer.start()
        wait_until(lambda: loader.closed, "close() to begin")
        gate.open_gate.set()
        closer.join(WAIT_S)
        assert not closer.is_alive()
        assert engine.issued == [(i * PAGE, PAGE) for i in range(5)]  # the piece read during close() is not copied
        assert pool.num_free == 4 and loader.num_live_threads == 0
        assert loader.stats.num_bytes == 5 * PAGE
        with pytest.raises(RuntimeError, match="the loader was closed while waiting for the checkpoint"):
            loader.wait_all(timeout_s=WAIT_S)
        with pytest.raises(RuntimeError, match="after close"):
            loader.start()
    finally:
        gate.open_gate.set()
        loader.close()


# ---- the DRAM tier: registered pages ------------------------------------------------------------

@needs_shm
@pytest.mark.parametrize("can_register, register_memory_backed", [(True, True), (False, True), (True, False)])
def test_dram_tier_pages_are_registered_and_copied_without_staging(tmp_path, source, can_register,
                                                                   register_memory_backed):
    with tempfile.TemporaryDirectory(dir=SHM) as shm:
        ckpt = _convert(tmp_path, source, Path(shm) / "thaw", chunk_bytes=PAGE)
        engine = CpuEngine(can_register=can_register)
        pool = _pool(engine, 4, 4 * PAGE)
        config = DeviceLoaderConfig(num_threads=2, register_memory_backed=register_memory_backed)
        with DeviceLoader(ckpt, engine, config, pool) as loader:
            tensors = loader.wait_all(timeout_s=WAIT_S)
            stats = loader.stats
        _assert_identical(tensors, source)
        registered = can_register and register_memory_backed
        assert stats.source_kind == ("dram-registered" if registered else "staged")
        assert (stats.num_registered_bytes, stats.num_staged_bytes) == ((143360, 0) if registered else (0, 143360))
        assert engine.num_register_calls == (9 if registered else 1 if register_memory_backed else 0)
        assert sorted(engine.registered) == sorted(engine.unregistered)
        if registered:
            assert pool.num_allocated == 0  # nothing pinned for staging
        else:
            assert 1 <= pool.num_allocated <= 4
        assert pool.num_free == 4


# ---- verification record ------------------------------------------------------------------------

def test_a_partition_verified_before_and_unchanged_is_not_hashed_again(tmp_path, source):
    ckpt = _convert(tmp_path, source, chunk_bytes=PAGE, partition_bytes=64 << 10)
    engine = CpuEngine()
    first = DeviceLoader(ckpt, engine, clock_ns=later)
    first.wait_all(timeout_s=WAIT_S)
    first.close()  # the record is written by the retire thread, joined here
    assert first.stats.num_trusted_bytes == 0
    for trust, trusted_bytes in ((True, 143360), (False, 0)):
        with DeviceLoader(ckpt, CpuEngine(), DeviceLoaderConfig(trust_verified=trust), clock_ns=later) as loader:
            _assert_identical(loader.wait_all(timeout_s=WAIT_S), source)
            assert loader.stats.num_trusted_bytes == trusted_bytes
            assert loader.stats.verified is True


# ---- configuration ------------------------------------------------------------------------------

def test_config_validation_names_the_field_and_the_fix():
    with pytest.raises(ValueError) as err:
        DeviceLoaderConfig(num_threads=0)
    assert str(err.value) == "DeviceLoaderConfig.num_threads is 0; use an integer in 1..256 (default 16)"
    with pytest.raises(ValueError, match="DeviceLoaderConfig.num_threads is True"):
        DeviceLoaderConfig(num_threads=True)
    with pytest.raises(ValueError) as err:
        DeviceLoaderConfig(piece_bytes=6000)
    assert str(err.value) == ("DeviceLoaderConfig.piece_bytes is 6000; use a positive multiple of 4096 "
                              "(default 2097152)")


# ---- CUDA ---------------------------------------------------------------------------------------

def _cuda_engine():
    from loader import CudaCopyEngine

    return CudaCopyEngine("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("register_memory_backed", [True, False])
@pytest.mark.parametrize("on_shm", [False, True])
def test_cuda_loads_every_tensor_onto_the_gpu(tmp_path, source, on_shm, register_memory_backed):
    if on_shm and not (SHM.is_dir() and is_memory_backed(SHM)):
        pytest.skip("no tmpfs at /dev/shm")
    where = tempfile.mkdtemp(dir=SHM if on_shm else tmp_path)
    try:
        ckpt = _convert(tmp_path, source, Path(where) / "thaw", chunk_bytes=4 * PAGE)
        config = DeviceLoaderConfig(num_threads=3, register_memory_backed=register_memory_backed)
        engine = _cuda_engine()
        with DeviceLoader(ckpt, engine, config, StagingPool(StagingConfig(2, PAGE), engine.allocate_host)) as loader:
            first = loader.wait_layer(0, timeout_s=WAIT_S)
            tensors = loader.wait_all(timeout_s=WAIT_S)
            stats = loader.stats
        assert all(t.device.type == "cuda" for t in tensors.values())
        _assert_identical(tensors, source)
        _assert_identical(first, {n: source[n] for n in first})
        assert len({t.untyped_storage().data_ptr() for t in tensors.values()}) == 1  # one device allocation
        registered = on_shm and register_memory_backed
        assert stats.source_kind == ("dram-registered" if registered else "staged"), stats
        assert stats.num_bytes == stats.total_bytes == 143360
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.cuda
def test_cuda_staging_buffers_are_pinned_and_registered_pages_are_page_locked(tmp_path):
    engine = _cuda_engine()
    pool = StagingPool(StagingConfig(2, 4 * PAGE), engine.allocate_host)
    pool.allocate_all()
    for slot in range(2):
        buffer = pool.buffer(slot)
        assert buffer.is_pinned() and buffer.data_ptr() % PAGE == 0 and buffer.numel() == 4 * PAGE
    from loader.memory_backed import map_read_only

    path = tmp_path / "pages.bin"
    path.write_bytes(bytes(range(256)) * 64)
    mapped = map_read_only(path, 4 * PAGE)
    assert not mapped.is_pinned()
    assert engine.register_host(mapped) is True
    try:
        assert mapped.is_pinned()
        on_gpu = torch.empty(4 * PAGE, dtype=torch.uint8, device="cuda")
        engine.copy_async(on_gpu, mapped).wait()
        assert torch.equal(on_gpu.cpu(), mapped)
    finally:
        engine.unregister_host(mapped)
