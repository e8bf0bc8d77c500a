"""The tier ledger with plain numbers: exact LRU order, what is never evicted, refusals that
evict nothing, and resizing after a fill."""

from __future__ import annotations

import itertools

import pytest

from storage.tier_ledger import TierFullError, TierLedger


def ledger(capacity: int) -> TierLedger:
    ticks = itertools.count(1000)
    return TierLedger("ssd", capacity, clock=lambda: float(next(ticks)))


def filled(capacity: int, *sizes: tuple[str, int]) -> TierLedger:
    led = ledger(capacity)
    for model, size in sizes:
        assert led.reserve(model, size) == []
        led.commit(model, size)
    return led


def test_lru_order_is_exact_and_touch_moves_to_the_back():
    led = filled(100, ("a", 30), ("b", 30), ("c", 30))
    led.touch("a")
    assert [m for m, _ in led.items()] == ["b", "c", "a"]
    assert led.reserve("d", 30) == ["b"]
    led.commit("d", 30)
    assert led.reserve("e", 50) == ["c", "a"]
    assert [m for m, _ in led.items()] == ["d", "e"]
    assert led.used_bytes == 80 and led.free_bytes == 20


def test_timestamps_are_reported_but_order_is_the_ledgers():
    led = TierLedger("dram", 100, clock=lambda: 5.0)  # every use in the same clock tick
    for model in "abc":
        led.reserve(model, 30)
        led.commit(model, 30)
    led.touch("a")
    assert led.plan_eviction(50) == ["b", "c"]
    assert {e.last_used_s for _, e in led.items()} == {5.0}


def test_pinned_loading_and_filling_entries_are_never_evicted():
    led = filled(100, ("pinned", 20), ("loading", 20), ("free1", 20), ("free2", 20))
    led.set_pinned("pinned", True)
    led.begin_load("loading")
    led.touch("pinned")
    led.touch("loading")  # order now: free1, free2, pinned, loading
    led.reserve("filling", 20)
    assert led.plan_eviction(40) == ["free1", "free2"]
    with pytest.raises(TierFullError, match=r"pinned \(20 bytes, pinned\).*loading \(20 bytes, 1 loading\)"
                                            r".*filling \(20 bytes, filling\)"):
        led.plan_eviction(41)


def test_a_refused_reservation_evicts_nothing():
    led = filled(100, ("a", 40), ("b", 40))
    led.set_pinned("b", True)
    with pytest.raises(TierFullError, match="cannot make room for 70 bytes"):
        led.reserve("big", 70)
    assert [m for m, _ in led.items()] == ["a", "b"] and "big" not in led


def test_larger_than_the_tier_says_so():
    with pytest.raises(TierFullError, match="larger than the tier"):
        ledger(10).plan_eviction(11)


def test_commit_resizes_and_evicts_if_the_fill_came_out_larger():
    led = filled(100, ("a", 30), ("b", 30))
    assert led.reserve("c", 20) == []
    assert led.commit("c", 50) == ["a"]  # 30 + 30 + 50 > 100: the least recently used goes
    assert [(m, e.num_bytes, e.filling) for m, e in led.items()] == [("b", 30, False), ("c", 50, False)]
    assert led.reserve("d", 10) == []
    assert led.commit("d", 5) == [] and led.used_bytes == 85  # smaller than reserved: nothing to do


def test_end_load_balances_begin_load_and_ignores_removed_entries():
    led = filled(100, ("a", 10))
    led.begin_load("a")
    led.begin_load("a")
    led.end_load("a")
    assert led.get("a").num_loading == 1 and not led.get("a").evictable
    led.end_load("a")
    assert led.get("a").evictable
    led.remove("a")
    led.end_load("a")  # a load that ends after the entry was invalidated


def test_adopted_entries_keep_their_order_and_shrink_to_capacity():
    led = ledger(50)
    for model, last_used in (("old", 1.0), ("mid", 2.0), ("new", 3.0)):
        led.adopt(model, 20, last_used)
    assert led.shrink_to_capacity() == ["old"]
    assert [m for m, _ in led.items()] == ["mid", "new"]


def test_reserving_a_held_model_is_a_bug():
    led = filled(100, ("a", 10))
    with pytest.raises(ValueError, match="already in the ssd tier"):
        led.reserve("a", 10)
    with pytest.raises(ValueError):
        TierLedger("ssd", -1)


# --- keep: a whole copy at once (the simulator's node tiers, `sim.sim_node`) ---------------------


def test_keep_evicts_the_least_recently_used_until_the_new_copy_fits():
    led = ledger(10)
    assert led.keep(1, 4) == [] and led.keep(2, 4) == []
    led.touch(1)  # 2 is now the least recently used
    assert led.keep(3, 4) == [2]
    assert led.models() == [1, 3] and led.used_bytes == 8
    assert led.keep(4, 10) == [1, 3]
    assert led.models() == [4] and led.used_bytes == 10 and len(led) == 1
    assert led.keep(4, 10) == [] and led.models() == [4]  # held already: touched, nothing evicted


def test_keep_holds_nothing_too_big_and_evicts_nothing_it_may_not():
    led = ledger(10)
    led.keep("a", 5)
    assert led.keep("b", 11) == [] and "b" not in led and "a" in led and not led.fits(11)
    empty = ledger(0)
    assert empty.keep("a", 1) == [] and len(empty) == 0 and not empty.fits(1)
    led.set_pinned("a", True)
    assert led.keep("c", 8) == [] and led.models() == ["a"]  # only the pinned one could make room


def test_used_bytes_follows_every_change():
    led = filled(100, ("a", 10), ("b", 20))
    assert led.used_bytes == 30
    led.reserve("c", 5)
    assert led.used_bytes == 35
    led.commit("c", 15)  # came out larger
    assert led.used_bytes == 45
    led.remove("a")
    led.adopt("d", 7, last_used_s=1.0)
    led.adopt("d", 9, last_used_s=2.0)  # adopted again: replaced, not added
    assert led.used_bytes == 20 + 15 + 9 == sum(e.num_bytes for _, e in led.items())
    assert led.free_bytes == 100 - led.used_bytes
