"""How long a new load waits on a node's read path (its SSD and the repository), as the node store
orders its fetches: a pure function both the controller and the simulator estimate with.

The store (`storage.fetch_queue`, `NodeStoreConfig.short_fetch_ratio` r) takes one fetch at a
time in arrival order, except that a load r times shorter than the one in flight pauses it and
goes first, and one r times shorter than a waiting load goes ahead of that one. So a new load of
L seconds waits for the loads before the first one with at least r * L seconds left, and for none
after: a 2 s first read of a small model on a node busy with a 400 s download waits 0 s, not
400 s. With r = 0 (strict arrival order) it waits for all of them, their sum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["check_short_fetch_ratio", "first_passed", "read_path_wait_s"]


def first_passed(load_s: float, loads_left_s: Sequence[float], short_fetch_ratio: float) -> int | None:
    """The index of the first load in `loads_left_s` (in the order they go, the one in flight
    first) that a new load of `load_s` goes ahead of, None if it goes last (module docstring).
    The simulator's read path (`sim.node_loader.ShortFirstLoader`) queues by it."""
    if not short_fetch_ratio:
        return None
    short_s = short_fetch_ratio * load_s
    return next((i for i, left_s in enumerate(loads_left_s) if short_s <= left_s), None)


def read_path_wait_s(load_s: float, loads_left_s: Sequence[float], short_fetch_ratio: float) -> float:
    """Seconds before a load of `load_s` starts on a path whose loads have `loads_left_s` left, in
    the order they go (the one in flight first), under the store's rule (module docstring)."""
    passed = first_passed(load_s, loads_left_s, short_fetch_ratio)
    return float(sum(loads_left_s if passed is None else loads_left_s[:passed]))


def check_short_fetch_ratio(value: object, name: str) -> float:
    """`value` as a ratio (0: strict arrival order, or a finite number >= 1); ValueError naming
    `name` otherwise."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not (value == 0 or value >= 1)):
        raise ValueError(f"{name} must be 0 (arrival order) or a number >= 1, got {value!r}")
    return float(value)
