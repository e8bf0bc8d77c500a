import pytest

from worker.block_manager import BlockManager


def test_allocation_is_exact_and_fifo():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.can_allocate("a", 5)
    assert bm.allocate("a", 5) == [0, 1]  # 5 tokens -> 2 blocks
    assert bm.allocate("a", 8) == []  # still fits in 2 blocks
    assert bm.allocate("a", 9) == [2]
    assert bm.allocate("b", 1) == [3]
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.num_free_blocks == 2 and bm.num_used_blocks == 4
    assert bm.num_missing_blocks("b", 12) == 2
    assert bm.can_allocate("b", 12) and not bm.can_allocate("b", 13)
    with pytest.raises(RuntimeError, match="only 2 free"):
        bm.allocate("b", 13)
    assert bm.block_table("b") == [3]  # a refused allocation changes nothing


def test_free_returns_blocks_in_order_and_reuses_them():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 4)  # [0, 1]
    bm.allocate("b", 3)  # [2, 3]
    assert bm.num_free_blocks == 0
    assert bm.free("a") == 2
    assert bm.free("a") == 0  # idempotent
    assert bm.allocate("c", 3) == [0, 1]
    bm.free("b")
    bm.free("c")
    assert bm.num_free_blocks == 4
    assert bm.allocate("d", 8) == [2, 3, 0, 1]


@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (4, 0)])
def test_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)
