"""StagingPool: aligned buffers allocated on first use, slots handed out and back, waiting and stopping."""

import threading
import time

import pytest
import torch

from loader import StagingConfig, StagingPool

WAIT_S = 30  # a guard so a bug fails the test instead of hanging it


def wait_until(predicate, what):
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


class CountingAllocator:
    def __init__(self):
        self.sizes = []

    def __call__(self, num_bytes):
        self.sizes.append(num_bytes)
        return torch.empty(num_bytes, dtype=torch.uint8)


def test_buffers_are_aligned_and_allocated_on_first_use():
    allocate = CountingAllocator()
    pool = StagingPool(StagingConfig(num_buffers=3, buffer_bytes=8192), allocate)
    assert (pool.num_allocated, pool.num_free) == (0, 3)
    slot = pool.acquire()
    assert slot == 0 and pool.num_free == 2
    buffer = pool.buffer(slot)
    assert buffer.numel() == 8192 and buffer.data_ptr() % 4096 == 0 and buffer.dtype == torch.uint8
    assert pool.buffer(slot).data_ptr() == buffer.data_ptr()  # the same buffer every time
    assert allocate.sizes == [8192 + 4096] and pool.num_allocated == 1
    pool.allocate_all()
    assert allocate.sizes == [12288] * 3 and pool.num_allocated == 3
    assert len({pool.buffer(s).data_ptr() for s in range(3)}) == 3
    pool.release(slot)
    assert pool.num_free == 3


def test_acquire_waits_for_a_release_and_gives_up_on_stop():
    pool = StagingPool(StagingConfig(num_buffers=1, buffer_bytes=4096), CountingAllocator())
    held = pool.acquire()
    got = []
    stop = threading.Event()
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(stop.is_set)))
    waiter.start()
    wait_until(lambda: pool.num_waiting == 1, "the waiter to block on the empty pool")
    assert got == []
    pool.release(held)
    waiter.join(WAIT_S)
    assert got == [held] and pool.num_waiting == 0
    quitter = threading.Thread(target=lambda: got.append(pool.acquire(stop.is_set)))
    quitter.start()
    wait_until(lambda: pool.num_waiting == 1, "the second waiter to block")
    stop.set()
    pool.wake()
    quitter.join(WAIT_S)
    assert got == [held, None] and pool.num_free == 0


def test_release_refuses_a_slot_twice_or_out_of_range():
    pool = StagingPool(StagingConfig(num_buffers=2, buffer_bytes=4096), CountingAllocator())
    with pytest.raises(ValueError, match=r"release\(0\): not a slot this pool handed out, or released twice"):
        pool.release(0)
    with pytest.raises(ValueError, match=r"release\(5\)"):
        pool.release(5)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_buffers": 0}, "StagingConfig.num_buffers is 0; use an integer in 1..1024 (default 16)"),
    ({"num_buffers": True}, "StagingConfig.num_buffers is True; use an integer in 1..1024 (default 16)"),
    ({"buffer_bytes": 5000}, "StagingConfig.buffer_bytes is 5000; use a positive multiple of 4096 "
                             "(default 16777216 = 16 MiB)"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError) as err:
        StagingConfig(**kwargs)
    assert str(err.value) == message
    assert StagingConfig().total_bytes == 256 << 20
