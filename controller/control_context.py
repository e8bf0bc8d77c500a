"""`ControlContext`: what the controller's collaborators share, handed to each as one record.

Every collaborator (the instance manager, the request mover, slot sharing and reclaim, the
placer, the registry, ...) reads the controller's two clocks, writes its decision log, runs its
background work in the controller's task set (cancelled or awaited at shutdown) and may wake its
reconcile loop. Before, each got those as four or five separate arguments; now the `Controller`
builds one context and passes it, so a new shared fact is added in one place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ControlContext"]


@dataclass(frozen=True)
class ControlContext:
    clock: Callable[[], float]  # the controller's monotonic clock: ticks, waits, deadlines
    wall_clock: Callable[[], float]  # wall time, for what a person reads (decisions, status)
    record: Callable[[dict[str, Any]], None]  # appends one decision to the controller's log
    background: set[asyncio.Task[None]]  # the controller's background tasks (drains, promotions, moves)
    wake: Callable[[], None]  # wakes the reconcile loop now (a slot came free, demand arrived)
