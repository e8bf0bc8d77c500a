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

from collections.abc import Sequence

__all__ = ["read_path_wait_s"]


def read_path_wait_s(load_s: float, loads_left_s: Sequence[float], short_fetch_ratio: float) -> float:
    """Seconds before a load of `load_s` starts on a path whose loads have `loads_left_s` left, in
    the order they go (the one in flight first), under the store's rule (module docstring)."""
    if not short_fetch_ratio:
        return float(sum(loads_left_s))
    short_s = short_fetch_ratio * load_s
    wait_s = 0.0
    for left_s in loads_left_s:
        if short_s <= left_s:  # it passes this one, so every one after it too
            break
        wait_s += left_s
    return wait_s
