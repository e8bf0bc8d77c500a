"""The gate of a node's repository fetches: its bound, strict arrival order, a place that is never
lost (a block that raises, a waiter interrupted), and short fetches passing long ones (waiting, or
paused between parts)."""

from __future__ import annotations

import threading

import pytest

from storage.fetch_queue import FetchQueue
from tests.storage.conftest import wait_until

WAIT_S = 30  # a guard so a bug fails the test instead of hanging it


def _hold(queue: FetchQueue, name: str, order: list, release: threading.Event, ahead: dict) -> threading.Thread:
    def run() -> None:
        with queue.turn() as turn:
            ahead[name] = turn.ahead
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
    with queue.turn() as turn:  # not stuck: the place came back
        assert turn.ahead == 0 and queue.num_in_flight == 1
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
    with queue.turn() as turn:
        assert turn.ahead == 0


def test_a_bad_bound_ratio_or_size_is_refused():
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="max_in_flight must be an integer >= 1"):
            FetchQueue(bad)
    for bad in (0.5, -1, float("nan"), float("inf"), True, "8"):
        with pytest.raises(ValueError, match="short_ratio must be 0 .arrival order. or a number >= 1"):
            FetchQueue(1, bad)
    with pytest.raises(ValueError, match="num_bytes must be an integer >= 0"):
        with FetchQueue(1).turn(-1):
            pass


class _Fetch(threading.Thread):
    """A fetch of `num_bytes` in parts of `part` bytes through `queue`: each part waits for the
    test's `parts` semaphore, so the test lets one part through at a time."""

    def __init__(self, queue: FetchQueue, name: str, num_bytes: int, part: int, log: list):
        super().__init__(name=name)
        self.queue, self.num_bytes, self.part, self.log = queue, num_bytes, part, log
        self.parts = threading.Semaphore(0)
        self.asking = threading.Event()  # set while in before_part (or waiting for its turn)
        self.turn = None

    def run(self) -> None:
        self.asking.set()
        with self.queue.turn(self.num_bytes) as turn:
            self.turn = turn
            for start in range(0, self.num_bytes, self.part):
                self.asking.set()
                turn.before_part(self.num_bytes - start)
                self.asking.clear()
                self.log.append((self.name, start))
                assert self.parts.acquire(timeout=WAIT_S)
        self.log.append((self.name, "done"))


def test_a_short_fetch_goes_ahead_of_long_ones_waiting_but_not_of_a_short_one():
    queue, log = FetchQueue(1, short_ratio=8), []
    first = _Fetch(queue, "first", 100, 100, log)
    first.start()
    wait_until(lambda: log == [("first", 0)], "the first fetch reading")
    long = _Fetch(queue, "long", 1000, 1000, log)
    long.start()
    wait_until(lambda: queue.num_waiting == 1, "the long fetch waiting")
    # 50 bytes: not 8 times shorter than what `first` has left (100), so it waits; but it is 8
    # times shorter than `long`, so it waits ahead of it. 20 bytes: ahead of `long`, not of `mid`.
    mid = _Fetch(queue, "mid", 50, 50, log)
    mid.start()
    wait_until(lambda: queue.num_waiting == 2, "the 50-byte fetch waiting")
    small = _Fetch(queue, "small", 20, 20, log)
    small.start()
    wait_until(lambda: queue.num_waiting == 3, "the 20-byte fetch waiting")
    for fetch in (first, mid, small, long):
        fetch.parts.release(fetch.num_bytes // fetch.part)
    for fetch in (first, mid, small, long):
        fetch.join(WAIT_S)
    assert [name for name, at in log if at == "done"] == ["first", "mid", "small", "long"]
    assert (mid.turn.ahead, small.turn.ahead, long.turn.ahead) == (1, 2, 1)
    assert queue.num_in_flight == 0 and queue.num_waiting == 0


def test_a_short_fetch_pauses_the_long_one_between_its_parts_and_it_resumes_where_it_stopped():
    queue, log = FetchQueue(1, short_ratio=8), []
    long = _Fetch(queue, "long", 1000, 100, log)
    long.start()
    wait_until(lambda: log == [("long", 0)], "the long fetch reading its first part")
    short = _Fetch(queue, "short", 100, 50, log)  # 900 left >= 8 * 100: it pauses `long`
    short.start()
    wait_until(lambda: log[-1] == ("short", 0), "the short fetch reading")
    long.parts.release()  # the part on the wire ends; the next one waits
    wait_until(lambda: long.asking.is_set() and queue.num_waiting == 1, "the long fetch paused")
    assert ("long", 100) not in log
    short.parts.release(2)
    short.join(WAIT_S)
    wait_until(lambda: ("long", 100) in log, "the long fetch going on")
    long.parts.release(9)
    long.join(WAIT_S)
    assert log == [("long", 0), ("short", 0), ("short", 50), ("short", "done"),
                   *[("long", at) for at in range(100, 1000, 100)], ("long", "done")]
    # Near its end a long fetch is not paused: 150 bytes left < 8 * 100.
    log.clear()
    long = _Fetch(queue, "long", 1000, 850, log)
    long.start()
    wait_until(lambda: log == [("long", 0)], "a new long fetch reading")
    long.parts.release()
    wait_until(lambda: log == [("long", 0), ("long", 850)], "its last part begun")
    late = _Fetch(queue, "late", 100, 100, log)
    late.start()
    wait_until(lambda: queue.num_waiting == 1, "the late short fetch waiting")
    long.parts.release()
    late.parts.release()
    long.join(WAIT_S)
    late.join(WAIT_S)
    assert [name for name, at in log if at == "done"] == ["long", "late"]


def test_a_paused_fetch_that_fails_leaves_the_line_and_the_next_goes_on():
    queue, log = FetchQueue(1, short_ratio=8), []
    failed = []

    def doomed() -> None:
        try:
            with queue.turn(1000) as turn:
                turn.before_part(1000)
                log.append(("doomed", 0))
                wait_until(lambda: queue.num_waiting == 1, "paused by the short fetch")
                raise RuntimeError("the part on the wire failed")
        except RuntimeError as e:
            failed.append(str(e))

    thread = threading.Thread(target=doomed)
    thread.start()
    wait_until(lambda: log == [("doomed", 0)], "the long fetch reading")
    short = _Fetch(queue, "short", 100, 100, log)
    short.start()
    thread.join(WAIT_S)
    assert failed == ["the part on the wire failed"] and queue.num_waiting == 0
    short.parts.release()
    short.join(WAIT_S)
    assert queue.num_in_flight == 0 and queue.num_waiting == 0
    with queue.turn(5) as turn:
        assert turn.ahead == 0
