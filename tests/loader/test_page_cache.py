"""`resident_runs` / `resident_prefix_bytes` answer from the real page cache and never read the file."""

import os

import pytest

from loader.page_cache import resident_prefix_bytes, resident_runs, residency_supported

pytestmark = pytest.mark.skipif(not residency_supported(), reason="no mincore on this platform")

PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(16 * PAGE))
    return path


def _evict(fd):
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def test_freshly_written_file_is_resident(data_file):
    fd = os.open(data_file, os.O_RDONLY)
    try:
        assert resident_prefix_bytes(fd, 0, 16 * PAGE) == 16 * PAGE
        assert resident_prefix_bytes(fd, 4 * PAGE, 3 * PAGE + 10) == 3 * PAGE + 10
    finally:
        os.close(fd)


def test_evicted_pages_end_the_prefix_and_asking_does_not_read_them(data_file):
    fd = os.open(data_file, os.O_RDONLY)
    try:
        _evict(fd)
        if resident_prefix_bytes(fd, 0, 16 * PAGE) != 0:
            pytest.skip("this filesystem keeps pages resident after POSIX_FADV_DONTNEED (e.g. tmpfs)")
        os.pread(fd, 2 * PAGE, 0)  # bring the first two pages in
        cached = resident_prefix_bytes(fd, 0, 16 * PAGE)
        # At least the pages read; readahead may have added more, but asking twice adds nothing.
        assert cached >= 2 * PAGE
        assert resident_prefix_bytes(fd, 0, 16 * PAGE) == cached
        _evict(fd)
        for _ in range(3):
            assert resident_prefix_bytes(fd, 0, 16 * PAGE) == 0  # the query itself caches nothing
    finally:
        os.close(fd)


def test_unaligned_offset_is_refused(data_file):
    fd = os.open(data_file, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="page size"):
            resident_prefix_bytes(fd, 100, PAGE)
        assert resident_prefix_bytes(fd, 0, 0) == 0
    finally:
        os.close(fd)


def test_runs_list_every_cached_stretch_around_an_evicted_hole(data_file):
    fd = os.open(data_file, os.O_RDONLY)
    try:
        assert resident_runs(fd, 0, 16 * PAGE) == [(0, 16 * PAGE)]
        _evict(fd)
        if resident_runs(fd, 0, 16 * PAGE):
            pytest.skip("this filesystem keeps pages resident after POSIX_FADV_DONTNEED (e.g. tmpfs)")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # read exactly the pages asked for
        os.pread(fd, 5 * PAGE, 0)  # pages 0..4 and 8..15 back in, 5..7 left out
        os.pread(fd, 8 * PAGE, 8 * PAGE)
        runs = resident_runs(fd, 0, 16 * PAGE)
        assert runs == [(0, 5 * PAGE), (8 * PAGE, 16 * PAGE)]
        assert resident_prefix_bytes(fd, 0, 16 * PAGE) == 5 * PAGE
        # Relative to the offset asked about, the last end clipped to the length.
        assert resident_runs(fd, 4 * PAGE, 6 * PAGE + 10) == [(0, PAGE), (4 * PAGE, 6 * PAGE + 10)]
    finally:
        os.close(fd)
