"""The order a node's repository fetches take: at most `max_in_flight` at once, the rest in
arrival order, except that a fetch `short_ratio` times smaller than another goes first.

Why a queue rather than every fetch at once: the fetches share the node's network path, and one
fetch already keeps it busy (its parts download in parallel, `ModelRepository.fetch`). Run side by
side, n fetches each move at 1/n of the rate, so every one of them ends later than its turn in a
queue would have it; under the contended scenario of issue 39 that lowered every policy's SLO
attainment in the simulator (`sim.node_loader`: Thaw's mean over seeds 0-9 0.790 queued against
0.705 shared). Strict arrival order (not `threading.Semaphore`, which lets a newcomer take a place
a woken waiter was about to): the controller's estimate of a load's wait sums the loads ahead of it.

Why short ones first (`short_ratio` r > 0, `NodeStoreConfig.short_fetch_ratio`): in arrival order
a first fetch of a 1 GB model queued behind a 141 GB one waits minutes for a read of seconds;
letting it pass costs the big one the few seconds of the small read. A fetch of b bytes goes ahead
of a waiting one with at least r * b bytes, and pauses the one in flight when that one has at
least r * b bytes left: the paused fetch stops between parts (`FetchTurn.before_part`, called by
the repository before each ranged read; the parts already on the wire finish) and goes on where it
stopped as soon as the short one ends, ahead of everything else waiting. The simulator's
`sim.node_loader.ShortFirstLoader` is the same rule; issue 39 measured r = 8 best there.

Written here rather than taken from a library: the standard library has no FIFO semaphore, let
alone one whose holders can be paused, and this is a few dozen lines over `threading`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["FetchQueue", "FetchTurn"]


class FetchTurn:
    """One fetch's place: `ahead` is how many fetches were before it when it came; the fetch calls
    `before_part(bytes_left)` before each part it reads, which blocks while the fetch is paused."""

    __slots__ = ("_queue", "num_bytes", "bytes_left", "ahead", "_go")

    def __init__(self, queue: FetchQueue, num_bytes: int) -> None:
        self._queue = queue
        self.num_bytes = num_bytes
        self.bytes_left = num_bytes  # as of its last `before_part`
        self.ahead = 0
        self._go = threading.Event()  # set while the fetch may read

    def before_part(self, bytes_left: int) -> None:
        """Called by the fetch before it reads its next part, with the bytes it has not begun
        (this part's included); returns when the fetch may read (at once unless it is paused)."""
        self._queue._progress(self, bytes_left)
        self._go.wait()


class FetchQueue:
    """A FIFO gate that lets short fetches pass long ones; thread-safe.
    ``with queue.turn(num_bytes) as turn: fetch(before_part=turn.before_part)``."""

    def __init__(self, max_in_flight: int = 1, short_ratio: float = 0.0):
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an integer >= 1, got {max_in_flight!r}")
        if (isinstance(short_ratio, bool) or not isinstance(short_ratio, (int, float)) or not math.isfinite(short_ratio)
                or (short_ratio != 0 and short_ratio < 1)):
            raise ValueError(f"short_ratio must be 0 (arrival order) or a number >= 1, got {short_ratio!r}")
        self.max_in_flight = max_in_flight
        self.short_ratio = float(short_ratio)
        self._lock = threading.Lock()
        self._reading: list[FetchTurn] = []  # in flight, at most max_in_flight
        self._waiting: list[FetchTurn] = []  # paused or not yet begun, in the order they go next

    @property
    def num_waiting(self) -> int:
        """Fetches not reading: paused, or not yet begun."""
        with self._lock:
            return len(self._waiting)

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._reading)

    @contextmanager
    def turn(self, num_bytes: int = 0) -> Iterator[FetchTurn]:
        """Wait for this fetch's turn, run the block, and hand the place on, even when the block
        raises or the wait is interrupted. `num_bytes`: what the fetch reads (0: unknown, which
        never passes nor is passed)."""
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0:
            raise ValueError(f"num_bytes must be an integer >= 0, got {num_bytes!r}")
        mine = FetchTurn(self, num_bytes)
        with self._lock:
            self._arrive(mine)
        try:
            mine._go.wait()
            yield mine
        finally:
            with self._lock:
                self._leave(mine)

    # -- under the lock ---------------------------------------------------------------------------

    def _passes(self, short: FetchTurn, other: FetchTurn) -> bool:
        return self.short_ratio > 0 and short.num_bytes > 0 and other.bytes_left >= self.short_ratio * short.num_bytes

    def _arrive(self, mine: FetchTurn) -> None:
        if len(self._reading) < self.max_in_flight and not self._waiting:
            self._start(mine)
            return
        if len(self._reading) >= self.max_in_flight:
            longest = max(self._reading, key=lambda t: t.bytes_left)
            if self._passes(mine, longest):  # pause it: it goes next, from where it stopped
                self._reading.remove(longest)
                longest._go.clear()
                self._waiting.insert(0, longest)
                self._start(mine)
                return
        at = next((i for i, other in enumerate(self._waiting) if self._passes(mine, other)), len(self._waiting))
        mine.ahead = len(self._reading) + at
        self._waiting.insert(at, mine)

    def _start(self, turn: FetchTurn) -> None:
        self._reading.append(turn)
        turn._go.set()

    def _progress(self, turn: FetchTurn, bytes_left: int) -> None:
        with self._lock:
            turn.bytes_left = max(0, min(turn.bytes_left, bytes_left))

    def _leave(self, turn: FetchTurn) -> None:
        if turn in self._reading:
            self._reading.remove(turn)
        elif turn in self._waiting:  # interrupted while waiting, or failed while paused: holds no place
            self._waiting.remove(turn)
        while self._waiting and len(self._reading) < self.max_in_flight:
            self._start(self._waiting.pop(0))
