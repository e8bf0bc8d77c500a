"""A node tier's LRU contents: exact eviction order, byte budget, and models that never fit."""

import pytest

from sim.tier_cache import TierCache


def test_lru_evicts_the_least_recently_used_until_the_new_copy_fits():
    cache = TierCache(10)
    assert cache.insert(1, 4) == [] and cache.insert(2, 4) == []
    cache.touch(1)  # 2 is now the least recently used
    assert cache.insert(3, 4) == [2]
    assert cache.model_indices() == [1, 3] and cache.used_bytes == 8
    assert cache.insert(4, 10) == [1, 3]
    assert cache.model_indices() == [4] and cache.used_bytes == 10


def test_a_copy_bigger_than_the_tier_is_not_kept_and_a_zero_tier_holds_nothing():
    cache = TierCache(10)
    cache.insert(1, 5)
    assert cache.insert(2, 11) == [] and 2 not in cache and 1 in cache
    empty = TierCache(0)
    assert empty.insert(1, 1) == [] and len(empty) == 0
    with pytest.raises(ValueError, match="capacity_bytes must be an integer >= 0"):
        TierCache(-1)
