"""Turns at stepping (`worker.serving.step_turns`): FIFO among equals, a bounded head start for priority,
at most `max_concurrent` at once, and the stated bound on how many steps one waits for."""

from __future__ import annotations

import threading

import pytest

from worker.serving.step_turns import StepTurns, turn_bound


def schedule(turns: StepTurns, arrivals: list[tuple[str, int]]) -> list[str]:
    """The order in which steps asked for in `arrivals` order (name, priority) get their turn while
    one step holds the only turn; each thread asks once the previous one is waiting."""
    order: list[str] = []
    hold = threading.Event()
    holder_in = threading.Event()

    def holder() -> None:
        with turns.turn():
            holder_in.set()
            hold.wait()

    def step(name: str, priority: int) -> None:
        with turns.turn(priority):
            order.append(name)

    threads = [threading.Thread(target=holder)]
    threads[0].start()
    holder_in.wait()
    for name, priority in arrivals:
        thread = threading.Thread(target=step, args=(name, priority))
        thread.start()
        threads.append(thread)
        while turns.num_waiting < len(threads) - 1:  # it asked: the next one asks after it
            threading.Event().wait(0.001)
    hold.set()
    for thread in threads:
        thread.join(5)
    return order


def test_equal_priorities_take_turns_in_the_order_they_asked():
    assert schedule(StepTurns(), [("a", 0), ("b", 0), ("c", 0)]) == ["a", "b", "c"]


def test_priority_overtakes_at_most_max_boost_earlier_steps_and_negative_gets_no_boost():
    # tickets: holder 0, a 1, b 2, c 3, hi 4 (boost 2 -> rank 2: after a, tied with b, which asked first)
    assert schedule(StepTurns(max_boost=2), [("a", 0), ("b", 0), ("c", 0), ("hi", 50)]) == ["a", "b", "hi", "c"]
    assert schedule(StepTurns(max_boost=2), [("a", 0), ("low", -50), ("b", 0)]) == ["a", "low", "b"]


def test_no_step_waits_for_more_than_the_bound_under_a_busy_mixed_load():
    """Four engines (one boosted), each stepping 50 times as fast as it can: no turn waited for more
    than (n - 1) + max_boost others, and never more than max_concurrent ran at once."""
    turns = StepTurns(max_concurrent=2, max_boost=3)
    running, most = [0], [0]
    lock = threading.Lock()

    def engine(priority: int) -> None:
        for _ in range(50):
            with turns.turn(priority):
                with lock:
                    running[0] += 1
                    most[0] = max(most[0], running[0])
                with lock:
                    running[0] -= 1

    threads = [threading.Thread(target=engine, args=(p,)) for p in (0, 0, 10, -5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert turns.num_turns == 200 and most[0] <= 2
    assert turns.max_overtaken <= turn_bound(4, 3) == 6


@pytest.mark.parametrize("kwargs, message", [({"max_concurrent": 0}, "max_concurrent"),
                                             ({"max_boost": -1}, "max_boost")])
def test_settings_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StepTurns(**kwargs)
