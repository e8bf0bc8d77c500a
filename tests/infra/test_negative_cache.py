"""`NegativeCache`: a bounded, expiring memory of names found not to exist (a fake clock, exact values)."""

from __future__ import annotations

import pytest

from infra.negative_cache import NegativeCache


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_a_miss_is_remembered_for_its_ttl_then_dropped():
    clock = Clock()
    cache = NegativeCache(2.0, clock=clock)
    cache.add("acme/x")
    assert "acme/x" in cache and "acme/y" not in cache
    clock.now = 11.999
    assert "acme/x" in cache
    clock.now = 12.0
    assert "acme/x" not in cache
    assert len(cache) == 0  # the expired entry went with the lookup


def test_adding_again_restarts_the_ttl_and_discard_forgets_at_once():
    clock = Clock()
    cache = NegativeCache(2.0, clock=clock)
    cache.add("a")
    clock.now = 11.5
    cache.add("a")
    clock.now = 13.0
    assert "a" in cache
    cache.add("b")
    cache.discard(["a", "never-added"])
    assert "a" not in cache and "b" in cache and len(cache) == 1


def test_the_oldest_entries_go_first_beyond_max_entries():
    cache = NegativeCache(60.0, max_entries=3, clock=Clock())
    for name in ("a", "b", "c", "d"):
        cache.add(name)
    assert len(cache) == 3
    assert [name in cache for name in ("a", "b", "c", "d")] == [False, True, True, True]
    cache.add("b")  # re-added: now the newest
    cache.add("e")
    assert [name in cache for name in ("b", "c", "d", "e")] == [True, False, True, True]


def test_ttl_zero_caches_nothing_and_bad_settings_are_refused():
    cache = NegativeCache(0.0, clock=Clock())
    cache.add("a")
    assert "a" not in cache and len(cache) == 0
    for ttl in (-1.0, float("inf"), float("nan"), True, "3"):
        with pytest.raises(ValueError, match="ttl_s must be a finite number >= 0"):
            NegativeCache(ttl)
    with pytest.raises(ValueError, match="max_entries must be an integer >= 1"):
        NegativeCache(1.0, max_entries=0)
