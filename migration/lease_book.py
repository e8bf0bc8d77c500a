"""Leases on the state a live migration leaves on an instance, so a driver that vanishes cannot
leave it there for ever.

A migration stops a request on its source (frozen: not scheduled, its KV and its client's stream
kept) and takes it in, paused, on its destination (KV blocks reserved). Both wait for the
driver's next step -- release or unfreeze, commit or cancel. If the driver dies between two steps
(the controller that ran it was killed), nobody would ever send it. So each of those states is a
*lease*: granted for ``lease_s`` seconds by the step that creates it, renewed by the driver while
it is alive (`MigrationAttempt` renews every ``lease_s / 3``), ended by the step that resolves
it. A lease that runs out is undone by the instance alone (`EngineEndpoint`): a frozen source
request carries on (its client's stream goes on from the source, whole), a paused import is
dropped and its blocks freed.

`LeaseBook` is the bookkeeping only -- request id -> deadline -- with time passed in, so it is
tested with plain numbers; the endpoint keeps one timer over it (the earliest deadline), not one
per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DEFAULT_LEASE_S", "LeaseBook", "validate_lease_s"]

# Long next to any step of a migration (a stop is milliseconds to a second), short next to a
# client's patience: a source whose driver died resumes its request within this.
DEFAULT_LEASE_S = 30.0


def validate_lease_s(lease_s: float, name: str = "lease_s") -> float:
    if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not math.isfinite(lease_s) \
            or lease_s <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {lease_s!r}")
    return float(lease_s)


@dataclass(frozen=True)
class _Lease:
    deadline: float
    lease_s: float


class LeaseBook:
    """Request id -> lease deadline; every method takes the time ``now`` (monotonic seconds)."""

    def __init__(self) -> None:
        self._leases: dict[str, _Lease] = {}

    def grant(self, request_id: str, lease_s: float, now: float) -> None:
        """Holds the request's state until ``now + lease_s`` (replacing a lease it had)."""
        lease_s = validate_lease_s(lease_s)
        self._leases[request_id] = _Lease(now + lease_s, lease_s)

    def renew(self, request_id: str, lease_s: float, now: float) -> bool:
        """Extends a lease held to ``now + lease_s``; False (nothing granted) if none is held."""
        lease_s = validate_lease_s(lease_s)
        if request_id not in self._leases:
            return False
        self._leases[request_id] = _Lease(now + lease_s, lease_s)
        return True

    def end(self, request_id: str) -> float | None:
        """Ends the request's lease (its state was resolved); returns its length, None if none was held."""
        lease = self._leases.pop(request_id, None)
        return None if lease is None else lease.lease_s

    def pop_expired(self, now: float) -> list[tuple[str, float]]:
        """Removes and returns the leases whose deadline is at or before ``now`` as (request id,
        lease length), earliest deadline first."""
        expired = sorted((lease.deadline, request_id, lease.lease_s) for request_id, lease in self._leases.items()
                         if lease.deadline <= now)
        for _, request_id, _ in expired:
            del self._leases[request_id]
        return [(request_id, lease_s) for _, request_id, lease_s in expired]

    def next_deadline(self) -> float | None:
        """The earliest deadline held; None if no lease is."""
        return min((lease.deadline for lease in self._leases.values()), default=None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)
