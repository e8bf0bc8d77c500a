"""A node's read path from its SSD and the repository, and how the loads in flight share it.

Three disciplines, chosen once per cluster (`ClusterSpec.concurrent_loads` and
`short_fetch_ratio`, `node_loader`):

- `ShortFirstLoader` (1 at a time, ratio r > 0; the default, r = 8): one load at a time, in
  arrival order, except that a load r times shorter than the one in flight pauses it and goes
  first, and one r times shorter than a waiting load goes ahead of that one; the paused load
  goes on where it stopped. The node store's fetches follow the same rule
  (`storage.fetch_queue`, `NodeStoreConfig.short_fetch_ratio`, pausing between a fetch's parts). Why: a first fetch of a 1 GB model queued behind a 141 GB
  one waited 400 s for a 3 s read; letting it pass costs the big one 3 s, under 1%. Issue 39
  measured it on the contended scenario (Thaw with slot hosts, seeds 0-9: mean SLO 0.790 -> 0.802,
  P99 better than ServerlessLLM-like's on 9 seeds, the tenth at the first-fetch floor; ratio 4 and
  16 did worse). Each load's end is known only when it comes: `join` the job for it.
- `QueuedLoader` (1 at a time, r = 0, `--short-fetch-ratio 0`): strict arrival order, as the
  store with ``short_fetch_ratio=0``; every table measured before the store fetched short first
  (BENCHMARKS.md). A load's end is known when it starts.
- `SharedLoader` (k > 1): up to k loads in flight share the path evenly (processor sharing), the
  rest wait in arrival order: n loads each move at 1/n of the path's rate, so a small checkpoint
  does not wait for a large one to end, but every load in flight ends later than its turn in a
  queue would have it. That is what the node store did before it queued its fetches (16 calls at
  once). Issue 39 measured both on the contended scenario: sharing lowered every policy's SLO
  attainment (Thaw's mean over seeds 0-9 from 0.790 to 0.705, ServerlessLLM-like's from 0.718 to
  0.698), so the store queues, and the simulator with it. A load's end is known only when it
  comes: `join` the job for it.

Work is counted in solo seconds, what the load takes alone on the path (`CostModel.load_s`). The
path is busy, at full rate, while any load is in flight, under either discipline. A load whose
instance stopped runs on to its end, as the store's fetch does (the path stays busy).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

from controller.read_path import first_passed

__all__ = ["LoaderJob", "QueuedLoader", "SharedLoader", "ShortFirstLoader", "join", "node_loader"]

_DONE_S = 1e-9  # a shared load with this little work left has ended (float rounding of the shares)


class LoaderJob:
    """One load on the path. `delay_s`: from its start to its end, when known at the start (a
    queue); `end_s`: when it ends, `math.inf` until known. `waiters`: what runs when it ends (a
    shared load's; `join`)."""

    __slots__ = ("remaining_s", "delay_s", "end_s", "waiters")

    def __init__(self, work_s: float) -> None:
        self.remaining_s = work_s
        self.delay_s: float | None = None
        self.end_s = math.inf
        self.waiters: list[tuple[Callable[..., Any], tuple]] = []


def _check_work(work_s: float) -> None:
    if isinstance(work_s, bool) or not isinstance(work_s, (int, float)) or not math.isfinite(work_s) or work_s < 0:
        raise ValueError(f"a load's work must be a finite number of seconds >= 0, got {work_s!r}")


class QueuedLoader:
    """One load at a time, in arrival order: each load's end is known when it starts."""

    __slots__ = ("_loop", "_free_s")

    def __init__(self, loop) -> None:
        self._loop = loop
        self._free_s = 0.0  # when the last load queued ends

    def start(self, work_s: float) -> LoaderJob:
        _check_work(work_s)
        now = self._loop.now
        wait_s = self._free_s - now if self._free_s > now else 0.0
        self._free_s = now + wait_s + work_s
        job = LoaderJob(work_s)
        job.delay_s = work_s + wait_s
        job.end_s = now + job.delay_s
        return job

    short_fetch_ratio = 0.0  # strict arrival order

    def backlog_s(self, now: float) -> float:
        """How long the path stays busy without another load: a new load's wait."""
        return self._free_s - now if self._free_s > now else 0.0

    def loads_left_s(self, now: float) -> tuple[float, ...]:
        """What the loads ahead of a new one have left, as one lump (in arrival order it waits
        for all of them: `controller.read_path`)."""
        left = self.backlog_s(now)
        return (left,) if left else ()


class SharedLoader:
    """Up to `max_in_flight` loads share the path evenly; the rest wait in arrival order."""

    __slots__ = ("_loop", "_max_in_flight", "_jobs", "_waiting", "_updated_s", "_timer")

    def __init__(self, loop, max_in_flight: int) -> None:
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 2:
            raise ValueError(f"a shared loader takes 2 or more loads at once, got {max_in_flight!r}")
        self._loop = loop
        self._max_in_flight = max_in_flight
        self._jobs: list[LoaderJob] = []  # in flight, in the order they joined: ties end in that order
        self._waiting: deque[LoaderJob] = deque()
        self._updated_s = 0.0
        self._timer = None

    def start(self, work_s: float) -> LoaderJob:
        """A load of `work_s` solo seconds joins the path (or its queue); `join` it for its end."""
        _check_work(work_s)
        job = LoaderJob(work_s)
        if len(self._jobs) < self._max_in_flight:
            self._advance()
            self._jobs.append(job)
            self._retime()
        else:
            self._waiting.append(job)
        return job

    def backlog_s(self, now: float) -> float:
        """The solo seconds of work the loads on the path have left: how long it stays busy
        without another load, and the controller's own estimate of a new load's wait
        (`controller.read_path.read_path_wait_s` with ratio 0 sums the loads' remaining estimates)."""
        if not self._jobs:
            return 0.0
        left = sum(job.remaining_s for job in self._jobs) - (now - self._updated_s)
        left += sum(job.remaining_s for job in self._waiting)
        return left if left > 0.0 else 0.0

    short_fetch_ratio = 0.0  # loads that share the path all move at once: none passes another

    def loads_left_s(self, now: float) -> tuple[float, ...]:
        """The backlog as one lump (a new load waits for all of it, `controller.read_path`)."""
        left = self.backlog_s(now)
        return (left,) if left else ()

    def _advance(self) -> None:
        now = self._loop.now
        if self._jobs and now > self._updated_s:
            share = (now - self._updated_s) / len(self._jobs)
            for job in self._jobs:
                job.remaining_s -= share
        self._updated_s = now

    def _retime(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._jobs:
            least = min(job.remaining_s for job in self._jobs)
            end_s = self._updated_s + max(least, 0.0) * len(self._jobs)
            self._timer = self._loop.schedule(end_s, self._end, priority=0)

    def _end(self) -> None:
        self._timer = None
        self._advance()
        bound = max(min(job.remaining_s for job in self._jobs), _DONE_S)
        ended = [job for job in self._jobs if job.remaining_s <= bound]
        self._jobs = [job for job in self._jobs if job.remaining_s > bound]
        while self._waiting and len(self._jobs) < self._max_in_flight:
            self._jobs.append(self._waiting.popleft())
        self._retime()
        now = self._loop.now
        for job in ended:
            job.remaining_s = 0.0
            job.end_s = now
            for callback, args in job.waiters:
                callback(*args)


class ShortFirstLoader:
    """One load at a time in arrival order, except that a load `ratio` times shorter than another
    goes ahead of it (pausing it when it is the one in flight; see the module docstring)."""

    __slots__ = ("_loop", "_ratio", "_current", "_waiting", "_started_s", "_timer")

    def __init__(self, loop, ratio: float) -> None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio < 1:
            raise ValueError(f"a short load goes first when it is ratio >= 1 times shorter, got {ratio!r}")
        self._loop = loop
        self._ratio = float(ratio)
        self._current: LoaderJob | None = None  # in flight since `_started_s`, `remaining_s` as of then
        self._waiting: list[LoaderJob] = []  # paused or not yet begun, in the order they go next
        self._started_s = 0.0
        self._timer = None

    def start(self, work_s: float) -> LoaderJob:
        """A load of `work_s` solo seconds joins the path (or its queue); `join` it for its end."""
        _check_work(work_s)
        job = LoaderJob(work_s)
        current = self._current
        if current is None:
            self._run(job)
            return job
        left = current.remaining_s - (self._loop.now - self._started_s)
        passed = first_passed(work_s, (left, *(other.remaining_s for other in self._waiting)), self._ratio)
        if passed == 0:  # pause the long load in flight: it goes next, from where it stopped
            current.remaining_s = left
            self._timer.cancel()
            self._waiting.insert(0, current)
            self._run(job)
            return job
        self._waiting.insert(len(self._waiting) if passed is None else passed - 1, job)
        return job

    def backlog_s(self, now: float) -> float:
        """How long the path stays busy without another load (the controller's estimate of a new
        load's wait, as `QueuedLoader.backlog_s`: a short load may wait less)."""
        if self._current is None:
            return 0.0
        return sum(self.loads_left_s(now))

    @property
    def short_fetch_ratio(self) -> float:
        return self._ratio

    def loads_left_s(self, now: float) -> tuple[float, ...]:
        """What each load on the path has left, in the order they go (the one in flight first):
        what `controller.read_path` needs to tell a short load's wait from a long one's."""
        if self._current is None:
            return ()
        left = self._current.remaining_s - (now - self._started_s)
        return (max(left, 0.0), *(job.remaining_s for job in self._waiting))

    def _run(self, job: LoaderJob) -> None:
        self._current = job
        self._started_s = self._loop.now
        self._timer = self._loop.schedule(self._started_s + job.remaining_s, self._end, priority=0)

    def _end(self) -> None:
        job = self._current
        job.remaining_s = 0.0
        job.end_s = self._loop.now
        self._current = self._timer = None
        if self._waiting:
            self._run(self._waiting.pop(0))
        for callback, args in job.waiters:
            callback(*args)


def join(job: LoaderJob, callback: Callable[..., Any], *args: Any) -> None:
    """`callback(*args)` runs when the shared load `job` ends, after those joined before it
    (several starts of a model whose fetch is in flight on the node wait for that one: the
    store's single flight)."""
    if job.delay_s is not None:
        raise ValueError("a queued load's end is known at its start: schedule on its end_s")
    if job.end_s != math.inf:
        raise ValueError("the load has ended already")
    job.waiters.append((callback, args))


def node_loader(loop, concurrent_loads: int, short_fetch_ratio: float) -> QueuedLoader | SharedLoader | ShortFirstLoader:
    """The discipline `ClusterSpec.concurrent_loads` and `short_fetch_ratio` ask for (see the
    module docstring; loads that share the path all move at once, so the ratio is for one at a
    time only)."""
    if concurrent_loads > 1:
        return SharedLoader(loop, concurrent_loads)
    return ShortFirstLoader(loop, short_fetch_ratio) if short_fetch_ratio else QueuedLoader(loop)
