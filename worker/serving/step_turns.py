"""Engines that share one process take turns at their steps (issue 38, Build 3).

A slot host (`worker.serving.slot_host`) holds several models, each with its own engine thread. Left
alone, every busy engine would step at once and the process's cores (or its GPU) would be split
among them by the OS (or the driver) in no order anyone chose. Instead each engine asks for a
turn before a step and gives it back after: at most `max_concurrent` steps run at a time (the
cores' or the device's worth), and the turns go in the order they were asked for -- token-level
time sharing, as Aegaeon does -- with a bounded head start for priority.

The rule, and its bound. A request for a turn gets ticket t (one counter for all engines) and
ranks at ``t - boost``, where ``boost = min(max(priority, 0), max_boost)``: a higher-priority
model may overtake at most `max_boost` later requests, a negative priority gets no boost (it is
never starved for it). An engine asks for one turn at a time, so with n engines in the host a
waiting step has at most n - 1 requests ranked ahead of it when it asks, and afterwards only
requests with tickets below t + max_boost can rank ahead of it: **a step waits for at most
(n - 1) + max_boost other steps** (divided among `max_concurrent` at once). `turn_bound` states
it; the tests check it on schedules. Ties in rank go to the earlier ticket.

Pure threading, no torch: the engine threads call it; nothing here knows what a step is.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import threading
from collections.abc import Iterator

__all__ = ["StepTurns", "turn_bound"]


def turn_bound(num_engines: int, max_boost: int) -> int:
    """The most other steps a step can wait for (see the module docstring)."""
    return max(0, num_engines - 1) + max_boost


class StepTurns:
    """Turns at stepping for the engines of one process (see the module docstring)."""

    def __init__(self, max_concurrent: int = 1, max_boost: int = 4) -> None:
        for name, value, minimum in (("max_concurrent", max_concurrent, 1), ("max_boost", max_boost, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"StepTurns.{name} must be an integer >= {minimum}, got {value!r}")
        self.max_concurrent = max_concurrent
        self.max_boost = max_boost
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._waiting: list[tuple[int, int]] = []  # heap of (rank, ticket)
        self._running = 0
        self.num_turns = 0  # turns given so far
        self.max_overtaken = 0  # the most steps any turn waited for (tests and ``thaw status``)
        self._started: dict[int, int] = {}  # ticket -> turns given when it asked

    def boost(self, priority: int | float) -> int:
        if not isinstance(priority, (int, float)) or isinstance(priority, bool) or math.isnan(priority):
            raise ValueError(f"priority must be a number, got {priority!r}")
        return int(min(max(priority, 0), self.max_boost))

    @contextlib.contextmanager
    def turn(self, priority: int | float = 0) -> Iterator[None]:
        """Blocks until it is this step's turn; the turn is given back when the block ends."""
        boost = self.boost(priority)
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            entry = (ticket - boost, ticket)
            heapq.heappush(self._waiting, entry)
            self._started[ticket] = self.num_turns
            while self._running >= self.max_concurrent or self._waiting[0] != entry:
                self._cond.wait()
            heapq.heappop(self._waiting)
            self.max_overtaken = max(self.max_overtaken, self.num_turns - self._started.pop(ticket))
            self._running += 1
            self.num_turns += 1
            self._cond.notify_all()  # another turn may start too, under max_concurrent
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @property
    def num_waiting(self) -> int:
        with self._cond:
            return len(self._waiting)
