"""The FIFO gate of a node's repository fetches: its bound, strict arrival order, and a place
that is never lost (a block that raises, a waiter interrupted)."""

from __future__ import annotations

import threading

import pytest

from storage.fetch_queue import FetchQueue
from tests.storage.conftest import wait_until

WAIT_S = 30  # a guard so a bug fails the test instead of hanging it


def _hold(queue: FetchQueue, name: str, order: list, release: threading.Event, ahead: dict) -> threading.Thread:
    def run() -> None:
        with queue.turn() as n:
            ahead[name] = n
            order.append(name)
            assert release.wait(WAIT_S)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_callers_take_turns_in_arrival_order_within_the_bound(max_in_flight):
    queue = FetchQueue(max_in_flight)
    order, ahead = [], {}
    releases = {name: threading.Event() for name in "abcd"}
    threads = []
    for i, name in enumerate("abcd"):
        threads.append(_hold(queue, name, order, releases[name], ahead))
        if i < max_in_flight:
            wait_until(lambda: len(order) == i + 1, f"{name} in flight")
        else:
            wait_until(lambda: queue.num_waiting == i + 1 - max_in_flight, f"{name} waiting")
    assert order == list("abcd"[:max_in_flight]) and queue.num_in_flight == max_in_flight
    for k, name in enumerate("abcd"):  # each one out lets exactly the next one in line in
        releases[name].set()
        wait_until(lambda: len(order) == min(4, max_in_flight + k + 1), "the next caller in")
    for thread in threads:
        thread.join(WAIT_S)
    assert order == list("abcd")
    assert [ahead[name] for name in "abcd"] == ([0, 1, 2, 3] if max_in_flight == 1 else [0, 0, 2, 3])
    assert queue.num_in_flight == 0 and queue.num_waiting == 0


def test_a_block_that_raises_hands_its_place_on():
    queue = FetchQueue(1)
    with pytest.raises(RuntimeError, match="fetch failed"):
        with queue.turn():
            raise RuntimeError("fetch failed")
    with queue.turn() as ahead:  # not stuck: the place came back
        assert ahead == 0 and queue.num_in_flight == 1
    assert queue.num_in_flight == 0


def test_a_waiter_interrupted_leaves_the_line_and_loses_no_place():
    queue = FetchQueue(1)
    release, interrupted = threading.Event(), threading.Event()

    class Interrupt(BaseException):
        pass

    def holder() -> None:
        with queue.turn():
            assert release.wait(WAIT_S)

    first = threading.Thread(target=holder)
    first.start()
    wait_until(lambda: queue.num_in_flight == 1, "the first fetch in flight")
    # A waiter whose wait is interrupted (as by KeyboardInterrupt) must leave the line.
    original_wait = threading.Event.wait

    def interrupting_wait(self, timeout=None):
        if threading.current_thread().name == "waiter":
            interrupted.set()
            raise Interrupt()
        return original_wait(self, timeout)

    def waiter() -> None:
        try:
            with queue.turn():
                raise AssertionError("an interrupted waiter must not get a turn")
        except Interrupt:
            pass

    threading.Event.wait = interrupting_wait
    try:
        second = threading.Thread(target=waiter, name="waiter")
        second.start()
        second.join(WAIT_S)
    finally:
        threading.Event.wait = original_wait
    assert interrupted.is_set() and queue.num_waiting == 0
    release.set()
    first.join(WAIT_S)
    assert queue.num_in_flight == 0
    with queue.turn() as ahead:
        assert ahead == 0


def test_a_bad_bound_is_refused():
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="max_in_flight must be an integer >= 1"):
            FetchQueue(bad)
