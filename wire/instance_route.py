"""`InstanceRoute`: one ready instance of a model, as the controller's routing table lists it.

The controller publishes its routing table (model id -> routes, under a version) and the gateway
routes from its copy; both build and read the routes with this one record, so a key written on
one side is the key read on the other. In the table a route travels in its dict form
(`WireRecord.to_dict`, tagged), which the gateway compares by content to tell a changed table
from an unchanged one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from wire.wire_record import WireRecord, check_count, check_name

__all__ = ["InstanceRoute"]


@dataclass(frozen=True)
class InstanceRoute(WireRecord):
    """Fields:
        instance_id: the instance.
        actor_name / namespace: its named actor (``ray.get_actor(actor_name, namespace=...)``);
            namespace None means the caller's own.
        node_id: the logical node it runs on.
        num_ongoing_requests: its load as last reported to the controller (stale by design).
        hosted: the actor is a slot host holding the instance (call it as
            ``wire.HostedInstance(actor, instance_id)``), not the instance's own.
    """

    SCHEMA: ClassVar[str] = "instance_route/1"

    instance_id: str
    actor_name: str
    namespace: str | None
    node_id: str
    num_ongoing_requests: int = 0
    hosted: bool = False

    def __post_init__(self) -> None:
        name = self.record_name()
        check_name(name, "instance_id", self.instance_id)
        check_name(name, "actor_name", self.actor_name)
        check_name(name, "namespace", self.namespace, optional=True)
        if not isinstance(self.node_id, str):
            raise ValueError(f"{name}.node_id must be a string, got {self.node_id!r}")
        object.__setattr__(self, "num_ongoing_requests",
                           check_count(name, "num_ongoing_requests", self.num_ongoing_requests))
        if not isinstance(self.hosted, bool):
            raise ValueError(f"{name}.hosted must be true or false, got {self.hosted!r}")
