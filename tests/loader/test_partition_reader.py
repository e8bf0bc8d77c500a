"""PartitionReader: page-cache probe then O_DIRECT, short reads, truncation and I/O errors."""

import errno
import os

import pytest

from loader import HostMemoryPool, TruncatedCheckpointError
from loader.partition_reader import PartitionReader, preadv_into

SIZE = 5 * 4096


@pytest.fixture()
def partition(tmp_path):
    path = tmp_path / "partition_000.bin"
    path.write_bytes(bytes(range(256)) * (SIZE // 256))
    return path


@pytest.fixture()
def buffer():
    return HostMemoryPool().acquire(SIZE)


def _o_direct_opens(path):
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


class CacheHolds:
    """Pretends the page cache holds the first `cached_bytes` of the file and nothing after."""

    def __init__(self, cached_bytes, max_read=None):
        self.cached_bytes = cached_bytes
        self.max_read = max_read
        self.calls = []

    def __call__(self, fd, destination, offset, flags=0):
        self.calls.append((offset, len(destination), flags))
        if flags & os.RWF_NOWAIT:
            if offset >= self.cached_bytes:
                raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
            destination = destination[: self.cached_bytes - offset]
        if self.max_read is not None:
            destination = destination[: self.max_read]
        return preadv_into(fd, destination, offset, flags)


    def residency(self, fd, offset, length):
        return max(0, min(length, self.cached_bytes - offset))


def test_cached_prefix_is_asked_without_io_then_copied_rest_with_o_direct(partition, buffer):
    if not _o_direct_opens(partition):
        pytest.skip("this filesystem refuses O_DIRECT")
    read = CacheHolds(cached_bytes=2 * 4096)
    reader = PartitionReader(partition, direct_io=True, read_fn=read, residency_fn=read.residency)
    reader.read_into(memoryview(buffer.numpy()), 0)
    reader.close()
    assert bytes(buffer.numpy()) == partition.read_bytes()
    assert (reader.num_cached_bytes, reader.num_direct_bytes, reader.num_buffered_bytes) == (8192, 12288, 0)
    # No probing read at all: the resident prefix is copied, the rest read with O_DIRECT.
    assert read.calls == [(0, 8192, 0), (8192, 12288, 0)]


def test_without_residency_queries_the_cache_is_probed_with_rwf_nowait(partition, buffer):
    if not _o_direct_opens(partition):
        pytest.skip("this filesystem refuses O_DIRECT")
    read = CacheHolds(cached_bytes=2 * 4096)
    reader = PartitionReader(partition, direct_io=True, read_fn=read, residency_fn=None)
    reader.read_into(memoryview(buffer.numpy()), 0)
    reader.close()
    assert bytes(buffer.numpy()) == partition.read_bytes()
    assert (reader.num_cached_bytes, reader.num_direct_bytes, reader.num_buffered_bytes) == (8192, 12288, 0)
    assert read.calls == [(0, SIZE, os.RWF_NOWAIT), (8192, 12288, os.RWF_NOWAIT), (8192, 12288, 0)]


def test_without_direct_io_there_is_no_probe(partition, buffer):
    read = CacheHolds(cached_bytes=SIZE)
    reader = PartitionReader(partition, direct_io=False, read_fn=read)
    reader.read_into(memoryview(buffer.numpy())[4096:], 4096)
    assert reader.direct_io is False
    assert (reader.num_cached_bytes, reader.num_direct_bytes, reader.num_buffered_bytes) == (0, 0, 16384)
    assert read.calls == [(4096, 16384, 0)]
    reader.close()


def test_short_reads_are_continued(partition, buffer):
    read = CacheHolds(cached_bytes=0, max_read=1000)
    reader = PartitionReader(partition, direct_io=False, read_fn=read)
    reader.read_into(memoryview(buffer.numpy()), 0)
    reader.close()
    assert bytes(buffer.numpy()) == partition.read_bytes()
    assert [offset for offset, _, _ in read.calls] == list(range(0, SIZE, 1000))


def test_file_shrinking_mid_load_raises_truncated(partition, buffer):
    reader = PartitionReader(partition, direct_io=False)
    os.truncate(partition, 3 * 4096)
    with pytest.raises(TruncatedCheckpointError) as err:
        reader.read_into(memoryview(buffer.numpy()), 0)
    reader.close()
    assert str(err.value) == (f"{partition} ended at byte 12288 while reading [0, 20480): "
                              f"the file shrank after the load started")


def test_io_errors_name_the_file_and_range(partition, buffer):
    def failing_read(fd, destination, offset, flags=0):
        raise OSError(errno.EIO, "Input/output error")

    reader = PartitionReader(partition, direct_io=False, read_fn=failing_read)
    with pytest.raises(OSError) as err:
        reader.read_into(memoryview(buffer.numpy())[:4096], 8192)
    reader.close()
    assert err.value.errno == errno.EIO
    assert str(err.value) == f"[Errno 5] Input/output error while reading bytes [8192, 12288) of {partition}"


def test_read_pieces_asks_the_cache_once_and_yields_each_piece_as_it_lands(partition, buffer):
    if not _o_direct_opens(partition):
        pytest.skip("this filesystem refuses O_DIRECT")
    read = CacheHolds(cached_bytes=3 * 4096)
    asked = []

    def residency(fd, offset, length):
        asked.append((offset, length))
        return read.residency(fd, offset, length)

    reader = PartitionReader(partition, direct_io=True, read_fn=read, residency_fn=residency)
    destination = memoryview(buffer.numpy())
    seen = []
    for piece in reader.read_pieces(destination, 0, 2 * 4096):
        seen.append((len(piece), bytes(piece)))
    reader.close()
    assert bytes(buffer.numpy()) == partition.read_bytes()
    assert [n for n, _ in seen] == [8192, 8192, 4096]
    assert b"".join(data for _, data in seen) == partition.read_bytes()  # each piece was in when yielded
    # One question for the whole range; the first piece is wholly cached (buffered copy), the
    # second half cached: read_into takes its cached page then O_DIRECT for the rest.
    assert asked[0] == (0, SIZE)
    assert (reader.num_cached_bytes, reader.num_direct_bytes) == (3 * 4096, 2 * 4096)


def test_read_pieces_past_the_cached_prefix_do_not_ask_again(partition, buffer):
    if not _o_direct_opens(partition):
        pytest.skip("this filesystem refuses O_DIRECT")
    read = CacheHolds(cached_bytes=0)
    asked = []

    def residency(fd, offset, length):
        asked.append((offset, length))
        return read.residency(fd, offset, length)

    reader = PartitionReader(partition, direct_io=True, read_fn=read, residency_fn=residency)
    list(reader.read_pieces(memoryview(buffer.numpy()), 0, 4096))
    reader.close()
    assert bytes(buffer.numpy()) == partition.read_bytes()
    assert asked == [(0, SIZE)]  # once for the range, not once per piece
    assert (reader.num_cached_bytes, reader.num_direct_bytes) == (0, SIZE)
