"""The simulator's clock: events run in (time, priority, sequence) order, cancelled ones never."""

import pytest

from sim.event_loop import EventLoop
from sim.tick_scheduler import TickScheduler


def test_events_run_by_time_then_priority_then_order_scheduled():
    loop = EventLoop()
    seen = []
    loop.schedule(2.0, seen.append, "t2")
    loop.schedule(1.0, seen.append, "t1-p1", priority=1)
    loop.schedule(1.0, seen.append, "t1-p0-first")
    loop.schedule(1.0, seen.append, "t1-p0-second")
    loop.schedule(0.5, lambda: loop.schedule_in(0.5, seen.append, "t1-p0-from-0.5"))
    loop.run()
    assert seen == ["t1-p0-first", "t1-p0-second", "t1-p0-from-0.5", "t1-p1", "t2"]
    assert loop.now == 2.0
    assert loop.num_events_run == 6


def test_cancelled_events_do_not_run_and_run_until_stops_the_clock():
    loop = EventLoop()
    seen = []
    event = loop.schedule(1.0, seen.append, "cancelled")
    loop.schedule(3.0, seen.append, "late")
    event.cancel()
    loop.run(until_s=2.0)
    assert seen == [] and loop.now == 2.0
    assert loop.next_time_s() == 3.0
    loop.run()
    assert seen == ["late"] and loop.now == 3.0


def test_the_past_cannot_be_scheduled():
    loop = EventLoop()
    loop.schedule(5.0, lambda: None)
    loop.run()
    with pytest.raises(ValueError, match="clock is already at 5.0"):
        loop.schedule(4.0, lambda: None)
    with pytest.raises(ValueError, match="finite"):
        loop.schedule(float("nan"), lambda: None)


def test_same_schedule_gives_the_same_run():
    def run():
        loop, seen = EventLoop(), []
        for i in range(50):
            loop.schedule((i * 7) % 5 * 0.5, seen.append, i, priority=i % 3)
        loop.run()
        return seen

    first = run()
    assert first == run()
    # t=0 holds the multiples of 5; of those, priority 0 (i % 3 == 0) first, in the order scheduled,
    # then priority 1 (10, 25, 40), then 2 (5, 20, 35).
    assert first[:10] == [0, 15, 30, 45, 10, 25, 40, 5, 20, 35]


def test_tick_scheduler_coalesces_wakes_and_defers_asks_made_during_a_tick():
    loop = EventLoop()
    ticks = []

    def on_tick(now):
        ticks.append(now)
        if now == 0.0:
            scheduler.wake_now()  # during a tick: the next grid point, not a loop at t=0

    scheduler = TickScheduler(loop, 1.0, on_tick)
    scheduler.wake_now()
    scheduler.wake_now()
    scheduler.wake_at(2.5)
    scheduler.wake_next()  # 1.0, already asked for by the tick itself later
    loop.run()
    assert ticks == [0.0, 1.0, 2.5]
    assert scheduler.num_ticks == 3


def test_a_timer_asked_for_before_a_wake_now_still_ticks_when_a_later_one_is_asked_for_in_a_tick():
    """A keep-alive timer (60 s), then a request (a tick now, which asks for the next grid point),
    then in that tick a later timer (100 s): the 60 s tick must still come. (It was lost: the tick
    at 41 s scheduled 100 s with 60 s still waiting behind the cancelled event.)"""
    loop = EventLoop()
    ticks = []

    def on_tick(now):
        ticks.append(now)
        if now == 1.0:
            scheduler.wake_at(60.0)  # a's keep-alive
        if now == 40.0:
            scheduler.wake_next()  # something changed: look again at the next grid point
        if now == 41.0:
            scheduler.wake_at(100.0)  # b's keep-alive

    scheduler = TickScheduler(loop, 1.0, on_tick)
    scheduler.wake_at(1.0)
    loop.schedule(40.0, scheduler.wake_now)  # b's request: the gateway wakes the controller
    loop.run()
    assert ticks == [1.0, 40.0, 41.0, 60.0, 100.0]


def test_a_feed_interleaves_with_the_heap_by_time_and_goes_first_at_equal_times():
    loop = EventLoop()
    seen = []
    items = iter([(0.5, seen.append, ("fed-0.5",)), (1.0, seen.append, ("fed-1.0",)),
                  (3.0, seen.append, ("fed-3.0",))])
    loop.schedule(1.0, seen.append, "scheduled-1.0")
    loop.schedule(2.0, seen.append, "scheduled-2.0")
    loop.feed(lambda: next(items, None))
    loop.run(until_s=2.5)
    assert seen == ["fed-0.5", "fed-1.0", "scheduled-1.0", "scheduled-2.0"]
    assert loop.now == 2.5 and loop.next_time_s() == 3.0  # the fed item waits past `until_s`
    loop.run()
    assert seen[-1] == "fed-3.0" and loop.now == 3.0 and loop.num_events_run == 5


def test_a_fed_item_from_the_past_runs_at_once_and_one_feed_at_a_time():
    loop = EventLoop()
    seen = []
    loop.schedule(2.0, lambda: seen.append(("scheduled", loop.now)))
    items = iter([(1.0, lambda: seen.append(("fed", loop.now)), ()),
                  (1.5, lambda: seen.append(("late", loop.now)), ())])
    loop.run()  # the clock reaches 2.0 before the feed exists
    loop.feed(lambda: next(items, None))
    loop.run()
    assert seen == [("scheduled", 2.0), ("fed", 2.0), ("late", 2.0)]
    other = EventLoop()
    other.feed(lambda: (1.0, seen.append, ("pending",)))
    with pytest.raises(ValueError, match="the loop already has a feed: merge the streams into one"):
        other.feed(lambda: None)
