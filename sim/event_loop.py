"""The simulator's one clock: a heap of timed events, run in a deterministic order.

Every moving part of a simulation (request arrivals, loads finishing, decode batches
completing, controller ticks) is a callback scheduled at a virtual time. `EventLoop.run`
pops them in order of

    (time, priority, sequence number)

so two events at the same instant run in the order of their `priority` (lower first: e.g. a
load that finishes at t is seen by the controller tick at t), and equal priorities in the order
they were scheduled. Nothing depends on wall time, hashing or dict iteration of floats, so the
same inputs give the same run, bit for bit. No sleeps, no threads, no asyncio: a simulated day
runs as fast as its callbacks.

Cancelling is lazy (a cancelled event stays in the heap, marked, and is skipped when popped):
O(1) to cancel, which matters because an instance's "next completion" event is rescheduled
every time its batch changes.

A *feed* (`feed(pull)`) is a stream of callbacks already in time order -- the workload's
arrivals, a third of all events -- kept beside the heap rather than in it: the loop pulls its
next item when the last one ran and runs it before any scheduled event of the same time (as
if its priority were below every other). No heap push and pop per arrival.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

__all__ = ["Event", "EventLoop"]


class Event:
    """A scheduled callback; `cancel()` it to keep it from running."""

    __slots__ = ("time_s", "callback", "args", "cancelled")

    def __init__(self, time_s: float, callback: Callable[..., Any], args: tuple) -> None:
        self.time_s = time_s
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    """A virtual clock (`now`, seconds from 0) and the events scheduled on it."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Event]] = []
        self._sequence = 0
        self.num_events_run = 0
        self._pull: Callable[[], tuple | None] | None = None
        self._fed: tuple | None = None  # the feed's next (time_s, callback, args)

    def feed(self, pull: Callable[[], tuple | None]) -> None:
        """Run the items `pull()` returns, `(time_s, callback, args)` in time order (an item
        earlier than the clock runs at once), until it returns None. One feed at a time."""
        if self._pull is not None:
            raise ValueError("the loop already has a feed: merge the streams into one")
        self._pull = pull
        self._take_fed()

    def _take_fed(self) -> None:
        item = self._pull()
        if item is None:
            self._pull = self._fed = None
            return
        time_s = item[0]
        if not math.isfinite(time_s):
            raise ValueError(f"a fed item's time must be a finite number of seconds, got {time_s!r}")
        self._fed = item if time_s >= self.now else (self.now, item[1], item[2])

    def schedule(self, time_s: float, callback: Callable[..., Any], *args: Any, priority: int = 0) -> Event:
        """Run `callback(*args)` at `time_s` (never before `now`: the past cannot be changed)."""
        if not math.isfinite(time_s):
            raise ValueError(f"an event's time must be a finite number of seconds, got {time_s!r}")
        if time_s < self.now:
            raise ValueError(f"cannot schedule an event at {time_s!r} s: the clock is already at {self.now!r} s")
        event = Event(time_s, callback, args)
        self._sequence += 1
        heapq.heappush(self._heap, (time_s, priority, self._sequence, event))
        return event

    def schedule_in(self, delay_s: float, callback: Callable[..., Any], *args: Any, priority: int = 0) -> Event:
        """Run `callback(*args)` `delay_s` seconds from now."""
        if not delay_s >= 0:
            raise ValueError(f"a delay must be >= 0 seconds, got {delay_s!r}")
        return self.schedule(self.now + delay_s, callback, *args, priority=priority)

    @property
    def num_pending(self) -> int:
        """Events in the heap, cancelled ones included (they leave when their time comes)."""
        return len(self._heap)

    def next_time_s(self) -> float | None:
        """When the next live event (or fed item) runs; None when nothing is scheduled."""
        heap = self._heap
        while heap and heap[0][3].cancelled:
            heapq.heappop(heap)
        times = [t for t in (heap[0][0] if heap else None, self._fed[0] if self._fed else None) if t is not None]
        return min(times) if times else None

    def run(self, until_s: float | None = None) -> None:
        """Run events in order until none is left (the clock stays at the last one), or until the
        next one is after `until_s` (then the clock stops at `until_s`)."""
        heap = self._heap
        pop = heapq.heappop
        limit = math.inf if until_s is None else until_s
        while True:
            fed = self._fed
            if heap and (fed is None or heap[0][0] < fed[0]):
                time_s, _, _, event = heap[0]
                if time_s > limit:
                    break
                pop(heap)
                if event.cancelled:
                    continue
                self.now = time_s
                self.num_events_run += 1
                event.callback(*event.args)
            elif fed is not None:
                time_s = fed[0]
                if time_s > limit:
                    break
                self.now = time_s
                self.num_events_run += 1
                self._take_fed()
                fed[1](*fed[2])
            else:
                break
        if until_s is not None and until_s > self.now and self.next_time_s() is not None:
            self.now = until_s
