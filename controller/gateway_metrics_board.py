"""`GatewayMetricsBoard`: the latest per-request series of every gateway replica, for its peers.

Each gateway replica counts only the requests it served, and a scrape reaches one replica. The
controller is the one actor every replica already talks to, so it keeps, per replica, the last
`wire.GatewayMetricsSnapshot` that replica sent, and answers each exchange with the others'
(see `infra.gateway_metrics`). A replica that stops sending (it was scaled down, its node died)
drops out after `stale_after_s`: its series end, as a dead process's would on a direct scrape.

Volatile by design: a restarted controller starts empty and is full again after one exchange
interval, since every replica sends its whole series each time (counters since the replica started).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from wire import GatewayMetricsSnapshot

__all__ = ["DEFAULT_STALE_AFTER_S", "GatewayMetricsBoard"]

DEFAULT_STALE_AFTER_S = 60.0


class GatewayMetricsBoard:
    """replica id -> (its last snapshot, when it came); see the module docstring."""

    def __init__(self, stale_after_s: float = DEFAULT_STALE_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s!r}")
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._latest: dict[str, tuple[GatewayMetricsSnapshot, float]] = {}

    def exchange(self, snapshot: GatewayMetricsSnapshot) -> list[GatewayMetricsSnapshot]:
        """Keeps `snapshot` as its replica's latest; returns every other replica's that is not
        stale, sorted by replica id (stale ones are forgotten)."""
        if not isinstance(snapshot, GatewayMetricsSnapshot):
            raise ValueError(f"snapshot must be a GatewayMetricsSnapshot, got {type(snapshot).__name__}")
        now = self._clock()
        self._latest[snapshot.replica_id] = (snapshot, now)
        for replica_id in [r for r, (_, at) in self._latest.items() if now - at > self._stale_after_s]:
            del self._latest[replica_id]
        return [s for replica_id, (s, _) in sorted(self._latest.items()) if replica_id != snapshot.replica_id]

    def replica_ids(self) -> list[str]:
        """The replicas heard from within `stale_after_s`, sorted."""
        now = self._clock()
        return sorted(r for r, (_, at) in self._latest.items() if now - at <= self._stale_after_s)
