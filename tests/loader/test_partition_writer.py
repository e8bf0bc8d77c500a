"""PartitionWriter: staging flushes on chunk boundaries, padding, hashes, refusals."""

import numpy as np
import pytest
import xxhash

from loader.partition_writer import PartitionWriter


def test_writes_through_a_small_staging_buffer(tmp_path):
    path = tmp_path / "partition_000.bin"
    writer = PartitionWriter(path, 0, chunk_bytes=4096, staging_bytes=8192)
    first = np.arange(20000, dtype=np.int64).astype(np.uint8)  # spans several staging flushes
    second = np.full(100, 9, dtype=np.uint8)
    writer.write(first)
    assert writer.offset == 20000
    writer.pad_to(20480)
    writer.write(second)
    entry = writer.finish()
    expected = first.tobytes() + bytes(480) + second.tobytes() + bytes(4096 - 100)
    assert path.read_bytes() == expected
    assert (entry.file, entry.size) == ("partition_000.bin", 24576)
    assert [(c.offset, c.size) for c in entry.chunks] == [(i * 4096, 4096) for i in range(6)]
    assert [c.xxh3_64 for c in entry.chunks] == [
        xxhash.xxh3_64_hexdigest(expected[i * 4096: (i + 1) * 4096]) for i in range(6)]


def test_last_chunk_is_shorter(tmp_path):
    writer = PartitionWriter(tmp_path / "p.bin", 3, chunk_bytes=3 * 4096, staging_bytes=5 * 4096)
    writer.write(np.ones(4 * 4096 + 1, dtype=np.uint8))
    entry = writer.finish()
    assert [(c.offset, c.size) for c in entry.chunks] == [(0, 12288), (12288, 8192)]
    assert entry.size == 20480


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="chunk_bytes 100 must be a positive multiple of 4096"):
        PartitionWriter(tmp_path / "p.bin", 0, chunk_bytes=100)
    writer = PartitionWriter(tmp_path / "p.bin", 0, chunk_bytes=4096)
    writer.write(np.zeros(10, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"pad_to\(4\) is behind the write position 10"):
        writer.pad_to(4)
    writer.abort()
    with pytest.raises(FileExistsError):  # never appends to or overwrites a partition
        PartitionWriter(tmp_path / "p.bin", 0, chunk_bytes=4096)
