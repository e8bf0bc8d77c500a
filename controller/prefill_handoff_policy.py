"""Which fully loaded instance finishes a prompt that waits on a streamed one: `plan_prefill_handoffs`.

While a new instance still receives its weights layer by layer, the prompts it took run through
the layers it has and then wait at the frontier for the next one (`worker.engine.zigzag_prefill`).
BlitzScale lets an instance that already holds every layer take such a prompt over at the layer
it reached (`migration.prefill_handoff`): its first token then costs the remaining layers'
compute instead of the remaining layers' transfer.

Rules for a helper: the same model; READY with every layer resident (a helper must run layers
k..N-1 itself); not on a draining node; below `saturated_requests` ongoing requests, counting
the prompts already given to it in this plan (a busy helper would slow its own requests and
the prompt's decode). Each waiting prompt goes to the least busy helper, then the smallest
instance id (stable); prompts are taken in order of their instance's id, then as reported (the
oldest pass first), and a prompt already being handed over is skipped.

A pure function of `ManagedInstance` fields: tested with plain values.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from controller.managed_instance import ManagedInstance
from wire import InstanceState

__all__ = ["PrefillHandoff", "plan_prefill_handoffs"]


@dataclass(frozen=True)
class PrefillHandoff:
    request_id: str
    source_id: str  # the streamed instance the prompt waits on
    helper_id: str  # the fully loaded instance that finishes it


def plan_prefill_handoffs(instances: Iterable[ManagedInstance], *, saturated_requests: int,
                          draining_node_ids: Collection[str] = (),
                          in_flight: Collection[str] = ()) -> list[PrefillHandoff]:
    """The hand-overs to make now (see the module docstring); `in_flight`: request ids whose
    hand-over is still running."""
    ready = [i for i in instances if i.phase is InstanceState.READY]
    load = {i.instance_id: i.num_ongoing_requests for i in ready}
    plan = []
    for source in sorted(ready, key=lambda i: i.instance_id):
        if source.weights_resident or not source.prefills_at_frontier:
            continue
        helpers = [i for i in ready if i.model_id == source.model_id and i.weights_resident
                   and i.node_id not in draining_node_ids]
        for request_id in source.prefills_at_frontier:
            if request_id in in_flight:
                continue
            free = [h for h in helpers if load[h.instance_id] < saturated_requests]
            if not free:
                break
            helper = min(free, key=lambda h: (load[h.instance_id], h.instance_id))
            load[helper.instance_id] += 1
            plan.append(PrefillHandoff(request_id, source.instance_id, helper.instance_id))
    return plan
