"""PartitionReader: page-cache probe then O_DIRECT, holes, short reads, truncation and I/O errors."""

import errno
import os

import pytest

from loader import HostMemoryPool, TruncatedCheckpointError
from loader.partition_reader import PartitionReader, plan_segments, preadv_into

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
        cached = max(0, min(length, self.cached_bytes - offset))
        return [(0, cached)] if cached else []


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


def test_plan_reads_short_interior_holes_through_the_cache_and_the_rest_directly():
    page = 4096
    # Cached [0, 4p) and [5p, 8p): the one-page hole between them is read with its neighbours.
    assert plan_segments([(0, 4 * page), (5 * page, 8 * page)], 10 * page, small_hole_bytes=2 * page) == [
        (0, 8 * page, True), (8 * page, 10 * page, False)]
    # A hole as long as the threshold goes to O_DIRECT.
    assert plan_segments([(0, page), (3 * page, 4 * page)], 4 * page, small_hole_bytes=2 * page) == [
        (0, page, True), (page, 3 * page, False), (3 * page, 4 * page, True)]
    # Uncached ends are never "short holes": they may run on into a cold neighbour.
    assert plan_segments([(2 * page, 3 * page)], 4 * page, small_hole_bytes=8 * page) == [
        (0, 2 * page, False), (2 * page, 3 * page, True), (3 * page, 4 * page, False)]
    assert plan_segments([], 4 * page) == [(0, 4 * page, False)]
    assert plan_segments([(0, 4 * page)], 4 * page) == [(0, 4 * page, True)]


class CacheWithHoles:
    """Pretends the page cache holds every page but those in `missing` (page numbers)."""

    def __init__(self, missing):
        self.missing = set(missing)
        self.calls = []

    def __call__(self, fd, destination, offset, flags=0):
        self.calls.append((offset, len(destination)))
        return preadv_into(fd, destination, offset, flags)

    def residency(self, fd, offset, length):
        runs, start = [], None
        for page in range(offset // 4096, -(-(offset + length) // 4096)):
            if page in self.missing:
                if start is not None:
                    runs.append((start, page * 4096 - offset))
                start = None
            elif start is None:
                start = page * 4096 - offset
        if start is not None:
            runs.append((start, length))
        return runs


def test_a_dropped_page_inside_a_cached_range_does_not_send_the_rest_to_disk(partition, buffer):
    if not _o_direct_opens(partition):
        pytest.skip("this filesystem refuses O_DIRECT")
    read = CacheWithHoles(missing={1})  # page 1 of 5 was dropped; the rest is cached
    reader = PartitionReader(partition, direct_io=True, read_fn=read, residency_fn=read.residency)
    pieces = [bytes(p) for p in reader.read_pieces(memoryview(buffer.numpy()), 0, 2 * 4096)]
    reader.close()
    assert b"".join(pieces) == partition.read_bytes()
    assert bytes(buffer.numpy()) == partition.read_bytes()
    # The old prefix rule read pages 1..4 with O_DIRECT; now nothing goes direct.
    assert (reader.num_cached_bytes, reader.num_direct_bytes, reader.num_buffered_bytes) == (4 * 4096, 0, 4096)
    assert read.calls == [(0, 8192), (8192, 8192), (16384, 4096)]  # one buffered read per piece


def test_read_into_reads_a_cold_tail_directly_after_the_cached_runs(partition, buffer):
    if not _o_direct_opens(partition):
        pytest.skip("this filesystem refuses O_DIRECT")
    read = CacheWithHoles(missing={1, 3, 4})  # hole 1 is short and interior; 3-4 is the cold end
    reader = PartitionReader(partition, direct_io=True, read_fn=read, residency_fn=read.residency)
    reader.read_into(memoryview(buffer.numpy()), 0)
    reader.close()
    assert bytes(buffer.numpy()) == partition.read_bytes()
    assert (reader.num_cached_bytes, reader.num_direct_bytes, reader.num_buffered_bytes) == (2 * 4096, 2 * 4096, 4096)
    assert read.calls == [(0, 3 * 4096), (3 * 4096, 2 * 4096)]
