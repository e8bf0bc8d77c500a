"""ThawCheckpointLoader: bit-exact round trips, per-layer readiness, integrity errors, I/O fallbacks."""

import errno
import os
import tempfile
import threading

import pytest
import torch

from loader import (ChecksumMismatchError, CheckpointFormatError, HostMemoryPool, LoaderConfig, ThawCheckpointLoader,
                    ThawIndex, TruncatedCheckpointError, convert_checkpoint, load_checkpoint)
from loader.partition_reader import preadv_into
from tests.loader.hf_checkpoint_builder import llama_tensors, write_hf_checkpoint

WAIT_S = 30  # a guard so a bug fails the test instead of hanging it; never reached when correct


def _convert(tmp_path, tensors, *, num_shards=1, **kwargs):
    hf = write_hf_checkpoint(tmp_path / "hf", tensors, num_shards=num_shards)
    kwargs.setdefault("progress", False)
    convert_checkpoint(hf, tmp_path / "thaw", **kwargs)
    return tmp_path / "thaw"


def _assert_identical(loaded, expected):
    assert list(loaded) != [] and sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_bit_identical(tmp_path, dtype, num_shards):
    source = llama_tensors(3, dtype, seed=1)
    tensors, stats = load_checkpoint(_convert(tmp_path, source, num_shards=num_shards, chunk_bytes=8192))
    _assert_identical(tensors, source)
    assert stats.num_bytes == stats.total_bytes
    assert stats.verified is True
    assert stats.num_threads == LoaderConfig().num_threads


@pytest.mark.parametrize("source_dtype, target", [
    (torch.float32, "bfloat16"), (torch.float32, "float16"), (torch.bfloat16, "float32"),
])
def test_dtype_conversion_equals_torch_cast(tmp_path, source_dtype, target):
    source = llama_tensors(2, source_dtype)
    source["model.layers.0.mlp.g_idx"] = torch.arange(7, dtype=torch.int32)  # not floating: kept as is
    source["model.layers.1.self_attn.scale"] = torch.tensor(0.125, dtype=source_dtype)  # 0-dim
    tensors, _ = load_checkpoint(_convert(tmp_path, source, num_shards=2, dtype=target))
    expected = {n: t if not t.is_floating_point() else t.to(getattr(torch, target)) for n, t in source.items()}
    _assert_identical(tensors, expected)
    assert tensors["model.layers.0.mlp.g_idx"].dtype == torch.int32


def test_wait_layer_returns_exactly_that_layer(tmp_path):
    source = llama_tensors(2, torch.bfloat16)
    with ThawCheckpointLoader(_convert(tmp_path, source, chunk_bytes=4096)) as loader:
        embedding = loader.wait_layer(-1, timeout_s=WAIT_S)
        layer0 = loader.wait_layer(0, timeout_s=WAIT_S)
        final = loader.wait_layer(2, timeout_s=WAIT_S)
        assert list(embedding) == ["model.embed_tokens.weight"]
        assert sorted(layer0) == sorted(n for n in source if n.startswith("model.layers.0."))
        assert list(final) == ["lm_head.weight", "model.norm.weight"]
        _assert_identical(layer0, {n: source[n] for n in layer0})
        loader.wait_all(timeout_s=WAIT_S)  # 4 threads: layer 2 may land before layer 1
        assert [loader.layer_ready(k) for k in (-1, 0, 1, 2)] == [True, True, True, True]
        # Views into the one load buffer, not copies.
        assert layer0["model.layers.0.mlp.up_proj.weight"].untyped_storage().data_ptr() == \
            final["lm_head.weight"].untyped_storage().data_ptr()
        with pytest.raises(ValueError, match="layer 3 does not exist: layers run from -1 .* to 2"):
            loader.wait_layer(3)
        del embedding, layer0, final


class GatedReads:
    """A read function that blocks every read at or beyond `gate_offset` until `open_gate` is set."""

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


def test_layer_zero_is_ready_while_a_later_layer_is_not(tmp_path):
    ckpt = _convert(tmp_path, llama_tensors(3, torch.bfloat16), chunk_bytes=4096)
    layer1_start = min(t.offset for t in ThawIndex.read(ckpt).tensors if t.layer == 1)
    gate = GatedReads(layer1_start)
    loader = ThawCheckpointLoader(ckpt, LoaderConfig(num_threads=1, direct_io=False), read_fn=gate)
    try:
        loader.start()
        assert sorted(loader.wait_layer(0, timeout_s=WAIT_S)) == [
            t.name for t in sorted(loader.index.tensors, key=lambda t: t.name) if t.layer == 0]
        assert gate.reached_gate.wait(WAIT_S)  # the reader is now held at layer 1's first chunk
        assert [loader.layer_ready(k) for k in (-1, 0, 1, 2, 3)] == [True, True, False, False, False]
        with pytest.raises(TimeoutError, match="layer 1 of .* not resident after 0 s"):
            loader.wait_layer(1, timeout_s=0)
        stats = loader.stats
        assert stats.num_bytes == layer1_start
        gate.open_gate.set()
        assert len(loader.wait_layer(1, timeout_s=WAIT_S)) == 9
        assert len(loader.wait_all(timeout_s=WAIT_S)) == 30  # 1 + 3 * 9 + 2
        assert [loader.layer_ready(k) for k in (-1, 0, 1, 2, 3)] == [True] * 5
    finally:
        gate.open_gate.set()
        loader.close()


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


def test_flipped_byte_raises_checksum_mismatch_naming_file_chunk_and_tensor(tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"
    ckpt = _convert(tmp_path, llama_tensors(2, torch.bfloat16), chunk_bytes=4096)
    path, position = _flip_byte(ckpt, name, 5000)
    chunk = position // 4096
    loader = ThawCheckpointLoader(ckpt)
    with pytest.raises(ChecksumMismatchError) as err:
        loader.wait_all(timeout_s=WAIT_S)
    message = str(err.value)
    assert message.startswith(f"{path}: chunk {chunk} (bytes [{chunk * 4096}, {chunk * 4096 + 4096})) has xxh3_64 ")
    assert message.endswith(f"; tensors in this chunk: {name}. The checkpoint is corrupt: convert or copy it again")
    # Every later wait fails too, even for a layer whose own chunks were fine.
    with pytest.raises(ChecksumMismatchError):
        loader.wait_layer(-1, timeout_s=WAIT_S)
    assert loader.layer_ready(-1) is False
    loader.close()


def test_verify_off_loads_the_corrupt_bytes(tmp_path):
    """verify_checksums=False trusts the disk: the flipped byte comes back as a different weight."""
    name = "model.layers.1.mlp.down_proj.weight"
    source = llama_tensors(2, torch.bfloat16)
    ckpt = _convert(tmp_path, source, chunk_bytes=4096)
    _flip_byte(ckpt, name, 5000)
    tensors, stats = load_checkpoint(ckpt, LoaderConfig(verify_checksums=False))
    assert stats.verified is False
    differs = (tensors[name].view(torch.int16) != source[name].view(torch.int16)).flatten().nonzero().flatten()
    assert differs.tolist() == [2500]  # byte 5000 is in element 2500
    _assert_identical({n: t for n, t in tensors.items() if n != name}, {n: t for n, t in source.items() if n != name})


def test_truncated_partition_is_refused_before_reading(tmp_path):
    ckpt = _convert(tmp_path, llama_tensors(2, torch.bfloat16), partition_bytes=65536)
    path = ckpt / "partition_001.bin"
    size = os.path.getsize(path)
    os.truncate(path, size - 4096)
    with pytest.raises(TruncatedCheckpointError) as err:
        ThawCheckpointLoader(ckpt)
    assert str(err.value) == (f"{path} is truncated: {size - 4096} bytes, the index expects {size}; "
                              f"copy or convert the checkpoint again")
    path.unlink()
    with pytest.raises(TruncatedCheckpointError, match=f"{path} is missing"):
        ThawCheckpointLoader(ckpt)


def test_missing_index_and_unknown_version(tmp_path):
    with pytest.raises(CheckpointFormatError, match=str(tmp_path / "thaw_index.json")):
        ThawCheckpointLoader(tmp_path)
    ckpt = _convert(tmp_path, llama_tensors(1, torch.bfloat16))
    index_path = ckpt / "thaw_index.json"
    index_path.write_text(index_path.read_text().replace('"format_version": 1', '"format_version": 7'))
    with pytest.raises(CheckpointFormatError, match="format_version 7 is not supported: this Thaw reads version 1"):
        load_checkpoint(ckpt)


class NoDirectIO:
    """A filesystem without O_DIRECT: EINVAL at open (or, with at_read, at the first read).

    Page-cache probes see a cold cache, so reads do reach the O_DIRECT path."""

    def __init__(self, at_read=False):
        self.at_read = at_read
        self.direct_fds = set()

    def open(self, path, flags):
        if flags & os.O_DIRECT and not self.at_read:
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = os.open(path, flags)
        if flags & os.O_DIRECT:
            self.direct_fds.add(fd)
        return fd

    def read(self, fd, destination, offset, flags=0):
        if flags & os.RWF_NOWAIT:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        if fd in self.direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return preadv_into(fd, destination, offset, flags)

    @staticmethod
    def residency(fd, offset, length):
        return []  # nothing cached


@pytest.mark.parametrize("at_read", [False, True])
def test_falls_back_to_buffered_reads_without_o_direct(tmp_path, at_read):
    source = llama_tensors(2, torch.float16)
    ckpt = _convert(tmp_path, source, chunk_bytes=8192)
    fs = NoDirectIO(at_read)
    with ThawCheckpointLoader(ckpt, open_fn=fs.open, read_fn=fs.read, residency_fn=fs.residency) as loader:
        _assert_identical(loader.wait_all(timeout_s=WAIT_S), source)
        stats = loader.stats
    assert stats.direct_io is False
    assert stats.num_direct_bytes == 0
    assert stats.num_bytes == stats.total_bytes


def _o_direct_works(directory):
    path = os.path.join(directory, "probe.bin")
    with open(path, "wb") as f:
        f.write(bytes(4096))
    buffer = HostMemoryPool().acquire(4096)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [buffer.numpy()], 0) == 4096
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        os.remove(path)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm tmpfs")
def test_loads_from_tmpfs(tmp_path):
    source = llama_tensors(2, torch.bfloat16)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        write_hf_checkpoint(tmp_path / "hf", source)
        convert_checkpoint(tmp_path / "hf", os.path.join(shm, "thaw"), progress=False)
        tensors, stats = load_checkpoint(os.path.join(shm, "thaw"), LoaderConfig(map_memory_backed=False))
        _assert_identical(tensors, source)
        assert not stats.mapped  # the read path, asked for (mapping is tested in test_memory_backed)
        # tmpfs takes O_DIRECT since Linux 6.6; older kernels refuse it and the loader reads buffered.
        assert stats.direct_io is _o_direct_works(shm)
        assert stats.num_bytes == stats.total_bytes
        del tensors


def test_pool_buffer_is_released_on_close_and_reused(tmp_path):
    ckpt = _convert(tmp_path, llama_tensors(2, torch.bfloat16))
    pool = HostMemoryPool()
    pool.reserve(1 << 20)
    with ThawCheckpointLoader(ckpt, pool=pool) as loader:
        first = loader.wait_all(timeout_s=WAIT_S)["lm_head.weight"].untyped_storage().data_ptr()
        assert loader.stats.num_bytes == loader.index.total_bytes == 143360
        assert pool.num_bytes_in_use == 1 << 20
    assert pool.num_bytes_in_use == 0
    with ThawCheckpointLoader(ckpt, pool=pool) as loader:
        assert loader.wait_all(timeout_s=WAIT_S)["lm_head.weight"].untyped_storage().data_ptr() == first
    assert pool.num_blocks == 1
    with pytest.raises(RuntimeError, match="after close"):
        loader.start()


def test_loader_config_validation():
    with pytest.raises(ValueError, match="LoaderConfig.num_threads is 0; use an integer in 1..256"):
        LoaderConfig(num_threads=0)
    with pytest.raises(ValueError, match="num_threads is True"):
        LoaderConfig(num_threads=True)


def test_chunks_hashed_piece_by_piece_verify_and_catch_a_flip_in_any_piece(tmp_path):
    source = llama_tensors(2, torch.float32, seed=4)
    ckpt = _convert(tmp_path, source, chunk_bytes=32768)
    tensors, stats = load_checkpoint(ckpt, LoaderConfig(piece_bytes=4096))  # 8 pieces per chunk
    _assert_identical(tensors, source)
    assert stats.verified
    partition = sorted(ckpt.glob("partition_*.bin"))[0]
    with open(partition, "r+b") as f:  # a byte in the 7th piece of the second chunk
        f.seek(32768 + 6 * 4096 + 123)
        byte = f.read(1)
        f.seek(32768 + 6 * 4096 + 123)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ChecksumMismatchError, match=r"chunk 1 \(bytes \[32768, 65536\)\)"):
        load_checkpoint(ckpt, LoaderConfig(piece_bytes=4096))


@pytest.mark.parametrize("piece", [0, 4095, 6000, True, "4096"])
def test_piece_bytes_must_be_a_multiple_of_the_alignment(piece):
    with pytest.raises(ValueError, match="LoaderConfig.piece_bytes"):
        LoaderConfig(piece_bytes=piece)
