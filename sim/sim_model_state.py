"""One simulated model's place in the cluster: its request queue and its live instances.

A record the cluster (`sim.sim_cluster`) writes and the policies read; its waits are computed as a
gateway reports them, so the policies see what the controller sees.
"""

from __future__ import annotations

from collections import deque

from sim.sim_instance import Flight, SimInstance
from wire import InstanceState

__all__ = ["SimModelState"]


class SimModelState:
    """One model in the cluster: its queue and its live (loading or ready) instances."""

    __slots__ = ("index", "model", "num_slots", "queue", "instances", "num_ongoing", "last_request_s",
                 "num_requests", "costs", "num_loading", "sleepers")

    def __init__(self, index: int, model, num_slots: int, costs) -> None:
        self.index = index
        self.model = model
        self.num_slots = num_slots
        self.sleepers: list[SimInstance] = []  # asleep on slot hosts, in the order they fell asleep
        self.costs = costs  # its `InstanceCosts`, shared by its instances
        self.num_loading = 0  # of `instances`, those still LOADING
        self.queue: deque[Flight] = deque()
        self.instances: list[SimInstance] = []
        self.num_ongoing = 0
        self.last_request_s: float | None = None
        self.num_requests = 0

    @property
    def model_id(self) -> str:
        return self.model.model_id

    def ready_instances(self) -> list[SimInstance]:
        return [i for i in self.instances if i.phase == InstanceState.READY]

    def oldest_wait_s(self, now: float) -> float:
        """As a gateway reports it: the longest any queued request has waited, a re-queued one
        from when it came back (the gateway's new ticket). Re-queued requests sit at the head and
        new arrivals behind them in arrival order, so the scan stops at the first new arrival."""
        oldest = None
        for flight in self.queue:
            if oldest is None or flight.queued_s < oldest:
                oldest = flight.queued_s
            if not flight.requeued:
                break
        return now - oldest if oldest is not None else 0.0

    def newest_wait_s(self, now: float) -> float | None:
        """As a gateway reports it: the shortest any queued request has waited (None: none waits)."""
        return now - max(flight.queued_s for flight in self.queue) if self.queue else None
