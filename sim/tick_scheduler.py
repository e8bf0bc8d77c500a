"""When the simulated controller ticks: on a grid of `tick_s`, at once on new demand, and at timers.

A real controller ticks every reconcile interval, and at once when a gateway reports a request
waiting. Ticking every `tick_s` of a simulated day whether or not anything changed would cost
86,400 policy passes for nothing, so the simulator ticks only when asked: `wake_now` (a request
is queued: the gateway wakes the controller), `wake_next` (something changed: the next grid
point), `wake_at(t)` (a policy's timer: a keep-alive or a scale delay running out). One event
is pending at a time, at the earliest wanted time (every later one is kept and comes in its
turn); asks during a tick go to the next grid
point, so a policy cannot loop at one instant. Tick events run after every other event at the
same time (priority 2), so a tick sees the loads and finishes of its instant.

The grid is fixed (multiples of `tick_s`) unless `from_last_tick`: then, as the controller's loop
waits `reconcile_interval_s` after each tick unless woken, the next periodic tick is `tick_s`
after the last one (or a multiple, had the loop ticked on its own meanwhile).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from sim.event_loop import Event, EventLoop

__all__ = ["TickScheduler"]

TICK_PRIORITY = 2


class TickScheduler:
    """See the module docstring; `on_tick(now)` runs the policy."""

    def __init__(self, loop: EventLoop, tick_s: float, on_tick: Callable[[float], None], *,
                 from_last_tick: bool = False) -> None:
        if not (isinstance(tick_s, (int, float)) and math.isfinite(tick_s) and tick_s > 0):
            raise ValueError(f"tick_s must be a finite number > 0, got {tick_s!r}")
        self._loop = loop
        self.tick_s = float(tick_s)
        self._on_tick = on_tick
        self._wanted: list[float] = []  # later times asked for, beside the pending event's
        self._wanted_set: set[float] = set()
        self._event: Event | None = None
        self._in_tick = False
        self.num_ticks = 0
        self.from_last_tick = from_last_tick
        self._last_tick_s = 0.0

    def next_grid_s(self) -> float:
        now = self._loop.now
        origin = self._last_tick_s if self.from_last_tick else 0.0
        return origin + (math.floor((now - origin) / self.tick_s + 1e-9) + 1) * self.tick_s

    def wake_now(self) -> None:
        self.wake_at(self._loop.now)

    def wake_next(self) -> None:
        self.wake_at(self.next_grid_s())

    def wake_at(self, time_s: float) -> None:
        now = self._loop.now
        if self._in_tick and time_s <= now:
            time_s = self.next_grid_s()
        time_s = max(time_s, now)
        if self._event is not None and self._event.time_s <= time_s:
            if self._event.time_s < time_s:
                self._want(time_s)
            return
        if self._event is not None:
            self._want(self._event.time_s)
            self._event.cancel()
        elif self._wanted and self._wanted[0] < time_s:
            # No event pending (asked during a tick), but an earlier time is still wanted: that
            # one goes first, or it would wait behind `time_s` (a lost keep-alive timer).
            self._want(time_s)
            time_s = heapq.heappop(self._wanted)
            self._wanted_set.discard(time_s)
        self._event = self._loop.schedule(time_s, self._tick, priority=TICK_PRIORITY)

    def _want(self, time_s: float) -> None:
        if time_s not in self._wanted_set:
            self._wanted_set.add(time_s)
            heapq.heappush(self._wanted, time_s)

    def _pop_due(self, now: float) -> None:
        wanted = self._wanted
        while wanted and wanted[0] <= now + 1e-9:
            self._wanted_set.discard(heapq.heappop(wanted))

    def _tick(self) -> None:
        now = self._loop.now
        self._event = None
        self._last_tick_s = now
        self._pop_due(now)
        self._in_tick = True
        try:
            self.num_ticks += 1
            self._on_tick(now)
        finally:
            self._in_tick = False
        self._pop_due(now)
        if self._wanted and self._event is None:
            next_s = heapq.heappop(self._wanted)
            self._wanted_set.discard(next_s)
            self._event = self._loop.schedule(next_s, self._tick, priority=TICK_PRIORITY)
