"""Where a migrated request goes: a pure function of the instances the controller knows.

`choose_destination` is what ``thaw migrate`` and a node drain ask: given the source instance,
every instance, the draining nodes and what the operator named (a node, an instance, or
nothing), the ready instance of the same model to move to, or why there is none. It deals in
`ManagedInstance` fields only, so it is tested with plain values.

Rules: the destination serves the same model (a migration carries tokens and KV, which only mean
something to the same weights), is READY (a loading instance cannot take a request; a stopping
one is leaving), is not the source, and is not on a draining node (it would have to move again).
Among those, the least loaded by its last report; ties by instance id, so the choice is stable.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from controller.managed_instance import ManagedInstance
from wire import InstanceState

__all__ = ["choose_destination"]


def choose_destination(source: ManagedInstance, instances: Iterable[ManagedInstance], draining_node_ids: Collection[str],
                       *, to_node: str | None = None, to_instance: str | None = None
                       ) -> tuple[ManagedInstance | None, str]:
    """(the destination, "") or (None, why there is none, in words an operator can act on)."""
    candidates = [i for i in instances if i.model_id == source.model_id and i.instance_id != source.instance_id]
    if to_instance is not None:
        named = [i for i in candidates if i.instance_id == to_instance]
        if not named:
            if to_instance == source.instance_id:
                return None, f"instance {to_instance} is the source itself"
            return None, f"no instance {to_instance!r} of model {source.model_id!r} is running"
        [chosen] = named
        if chosen.phase is not InstanceState.READY:
            return None, f"instance {to_instance} is {chosen.phase.value}, not ready"
        if chosen.node_id in draining_node_ids:
            return None, f"instance {to_instance} is on node {chosen.node_id}, which is draining"
        return chosen, ""
    ready = [i for i in candidates if i.phase is InstanceState.READY and i.node_id not in draining_node_ids]
    if to_node is not None:
        if to_node in draining_node_ids:
            return None, f"node {to_node} is draining"
        ready = [i for i in ready if i.node_id == to_node]
        if not ready:
            return None, (f"no ready instance of model {source.model_id!r} on node {to_node}; scale the model "
                          "up there first (thaw scale) or name another node")
    if not ready:
        return None, (f"no other ready instance of model {source.model_id!r} (outside draining nodes) to take "
                      "its requests; scale it up first (thaw scale)")
    return min(ready, key=lambda i: (i.num_ongoing_requests, i.instance_id)), ""
