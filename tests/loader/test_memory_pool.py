"""HostMemoryPool: alignment, best-fit reuse, reserve, accounting."""

import pytest
import torch

from loader import HostMemoryPool


def test_buffers_are_aligned_uint8_of_the_requested_size():
    pool = HostMemoryPool()
    buffers = [pool.acquire(n) for n in (1, 4095, 4096, 10_000, 1 << 20)]
    assert [b.numel() for b in buffers] == [1, 4095, 4096, 10_000, 1 << 20]
    assert all(b.dtype == torch.uint8 and b.device.type == "cpu" for b in buffers)
    assert [b.data_ptr() % 4096 for b in buffers] == [0, 0, 0, 0, 0]
    assert pool.num_bytes_reserved == pool.num_bytes_in_use == 4096 + 4096 + 4096 + 12288 + (1 << 20)


def test_released_buffer_is_reused():
    pool = HostMemoryPool()
    first = pool.acquire(10_000)
    first[:] = 7
    address = first.data_ptr()
    pool.release(first)
    assert (pool.num_bytes_reserved, pool.num_bytes_in_use) == (12288, 0)
    second = pool.acquire(5_000)
    assert second.data_ptr() == address
    assert pool.num_blocks == 1
    assert pool.num_bytes_in_use == 12288


def test_best_fit_picks_the_smallest_free_block_that_fits():
    pool = HostMemoryPool()
    for nbytes in (64 * 4096, 4 * 4096, 8 * 4096):
        pool.reserve(nbytes)
    assert (pool.num_blocks, pool.num_bytes_reserved, pool.num_bytes_in_use) == (3, 76 * 4096, 0)
    medium = pool.acquire(5 * 4096)
    small = pool.acquire(4 * 4096)
    large = pool.acquire(9 * 4096)
    assert pool.num_blocks == 3  # all three came from the reservations
    assert pool.num_bytes_in_use == 76 * 4096
    bigger = pool.acquire(65 * 4096)  # nothing free fits: a new block
    assert pool.num_blocks == 4
    assert pool.num_bytes_reserved == 141 * 4096
    for b in (medium, small, large, bigger):
        pool.release(b)
    assert pool.num_bytes_in_use == 0


def test_reserve_rounds_up_and_acquire_uses_it():
    pool = HostMemoryPool()
    pool.reserve(5000)
    assert pool.num_bytes_reserved == 8192
    buffer = pool.acquire(8192)
    assert pool.num_blocks == 1
    assert buffer.data_ptr() % 4096 == 0
    buffer[:] = 1  # writable over its whole length
    assert int(buffer.sum()) == 8192


def test_release_errors_and_clear():
    pool = HostMemoryPool()
    buffer = pool.acquire(4096)
    with pytest.raises(ValueError, match="not acquired from this pool, or was already released"):
        pool.release(torch.empty(4096, dtype=torch.uint8))
    pool.release(buffer)
    with pytest.raises(ValueError, match="already released"):
        pool.release(buffer)
    kept = pool.acquire(100)
    pool.reserve(8192)
    assert pool.clear() == 8192
    assert (pool.num_blocks, pool.num_bytes_reserved, pool.num_bytes_in_use) == (1, 4096, 4096)
    pool.release(kept)
    with pytest.raises(ValueError, match="nbytes must be > 0"):
        pool.reserve(0)


def test_pin_memory_is_ignored_without_an_accelerator():
    pool = HostMemoryPool(pin_memory=True)
    assert pool.pin_memory is torch.accelerator.is_available()
    assert pool.acquire(4096).is_pinned() is pool.pin_memory
