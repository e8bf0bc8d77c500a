"""Least-loaded routing over a model's ready instances, as one gateway sees them.

The gateway counts the requests it has on each instance itself (its own in-flight count is
exact and current; the controller's report of each instance's ongoing requests is stale by
design and only breaks ties), caps them per instance (``max_ongoing_requests_per_instance``),
and skips an instance that just failed a request for ``broken_instance_s`` so the retry goes
elsewhere. Plain bookkeeping over ids and a clock: tested with numbers, no Ray and no loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from infra.serving_cluster import InstanceRoute

__all__ = ["InstancePicker"]


class InstancePicker:
    """Picks, reserves and releases instance slots; remembers which instances to skip a while."""

    def __init__(self, max_ongoing_per_instance: int, broken_instance_s: float, clock: Callable[[], float]) -> None:
        self._cap = max_ongoing_per_instance
        self._broken_s = broken_instance_s
        self._clock = clock
        self._inflight: dict[str, int] = {}  # instance id -> requests this gateway has on it
        self._broken: dict[str, float] = {}  # instance id -> skipped until (clock)

    def pick(self, routes: Sequence[InstanceRoute]) -> InstanceRoute | None:
        """The least-loaded usable instance under the cap (ties: the controller's last report,
        then the id), or None."""
        now = self._clock()
        best: tuple[int, int, str] | None = None
        chosen = None
        for route in routes:
            if self._broken.get(route.instance_id, 0.0) > now:
                continue
            load = self._inflight.get(route.instance_id, 0)
            if load >= self._cap:
                continue
            key = (load, route.num_ongoing_requests, route.instance_id)
            if best is None or key < best:
                best, chosen = key, route
        return chosen

    def reserve(self, route: InstanceRoute) -> None:
        self._inflight[route.instance_id] = self._inflight.get(route.instance_id, 0) + 1

    def release(self, route: InstanceRoute) -> None:
        left = self._inflight.get(route.instance_id, 0) - 1
        if left > 0:
            self._inflight[route.instance_id] = left
        else:
            self._inflight.pop(route.instance_id, None)

    def mark_broken(self, route: InstanceRoute) -> None:
        """Skips the instance for ``broken_instance_s`` (it just failed a request)."""
        self._broken[route.instance_id] = self._clock() + self._broken_s

    def keep_only(self, live_instance_ids: Iterable[str]) -> None:
        """Forgets the broken marks of instances no longer in the routing table."""
        live = set(live_instance_ids)
        self._broken = {i: until for i, until in self._broken.items() if i in live}

    def inflight(self) -> dict[str, int]:
        """Requests this gateway has on each instance now (a copy; instances with none left out)."""
        return dict(self._inflight)
