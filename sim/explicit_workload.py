"""A request list given as it is: `explicit_workload`, the workload of a replay.

The fitted workloads (`sim.workload`) draw arrivals from traces' statistics; replaying a real
run (bench/sim_fidelity.py replays bench/multimodel.py's) needs its exact requests instead: each
one's arrival time, model, prompt tokens and ``max_tokens``. This checks such a list once, before
the run, so a bad row fails with its position rather than deep inside the event loop, and keeps
its order: the simulator's per-request results (`SimResult.ttft_s`) are then in the caller's order.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

from sim.workload import SimRequest

__all__ = ["explicit_workload"]


def explicit_workload(requests: Iterable[SimRequest], model_ids: Collection[str]) -> list[SimRequest]:
    """`requests` as a list, checked: each a `SimRequest` of a model in `model_ids`, arriving at a
    finite time >= 0, no earlier than the one before it (the simulator feeds arrivals in order),
    with >= 1 input and output token."""
    known = set(model_ids)
    checked: list[SimRequest] = []
    last_s = 0.0
    for position, request in enumerate(requests):
        where = f"request {position}"
        if not isinstance(request, SimRequest):
            raise ValueError(f"{where}: must be a SimRequest, got {type(request).__name__}")
        arrival = request.arrival_s
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) \
                or arrival < 0:
            raise ValueError(f"{where}: arrival_s must be a finite number >= 0, got {arrival!r}")
        if arrival < last_s:
            raise ValueError(f"{where}: arrives at {arrival!r} s, before the request ahead of it ({last_s!r} s); "
                             f"sort the requests by arrival")
        if request.model_id not in known:
            raise ValueError(f"{where}: model {request.model_id!r} is not in the catalog")
        for name in ("input_tokens", "output_tokens"):
            value = getattr(request, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
        last_s = arrival
        checked.append(request)
    return checked
