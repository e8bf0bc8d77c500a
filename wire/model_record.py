"""`ModelRecord`: a deployed model as the controller tells the gateway about it.

The gateway keeps a card per model (``GET /v1/models``: id, owner, creation time, context
length) and a queue per model (how many requests may wait for an instance, and for how long),
and counts cold starts by the tier each new instance's checkpoint was read from. All of it comes
from this record, which the controller builds (``Controller.model_records``) and the gateway
reads: before it, the gateway read the controller's spec dicts with guessed keys, one of them
(the deploy time) written by nobody, so ``created`` was 0 on the Ray path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from wire.tool_call_format import TOOL_CALL_FORMATS
from wire.wire_record import WireRecord, check_count, check_name, check_optional_seconds, check_seconds

__all__ = ["InstanceLoadRecord", "ModelRecord"]


@dataclass(frozen=True, kw_only=True)
class InstanceLoadRecord(WireRecord):
    """How one instance of the model was loaded.

    Fields:
        instance_id: the instance.
        tier: the node-store tier its checkpoint was read from ("dram", "ssd"); None when unknown
            (an instance a restarted controller adopted).
        load_s: the worker's own load time; None until the instance is ready.
    """

    SCHEMA: ClassVar[str] = "instance_load/1"

    instance_id: str
    tier: str | None
    load_s: float | None

    def __post_init__(self) -> None:
        name = self.record_name()
        check_name(name, "instance_id", self.instance_id)
        check_name(name, "tier", self.tier, optional=True)
        object.__setattr__(self, "load_s", check_optional_seconds(name, "load_s", self.load_s))


@dataclass(frozen=True, kw_only=True)
class ModelRecord(WireRecord):
    """Fields:
        model_id: ``"tenant/name"``.
        deployed_s: Unix time the model was deployed (OpenAI's ``created``); None when this
            controller does not know it (a model it found in the state store after a restart).
        max_model_len: longest prompt + output in tokens; None means the model's own limit.
        max_queued_requests / queue_timeout_s: the gateway's queue for the model (the spec's
            autoscaling section).
        instances: its instances now, with how each was loaded.
        tool_call_format: how the model writes tool calls (one of `TOOL_CALL_FORMATS`), which the
            gateway parses out of a chat's output when the request gives ``tools``; None: the
            model has none the gateway can read (tool calls then stay text).
    """

    SCHEMA: ClassVar[str] = "model_record/1"

    model_id: str
    deployed_s: float | None
    max_model_len: int | None
    max_queued_requests: int
    queue_timeout_s: float
    instances: tuple[InstanceLoadRecord, ...] = ()
    tool_call_format: str | None = None

    def __post_init__(self) -> None:
        name = self.record_name()
        if self.tool_call_format is not None and self.tool_call_format not in TOOL_CALL_FORMATS:
            raise ValueError(f"{name}.tool_call_format must be None or one of {', '.join(TOOL_CALL_FORMATS)}, "
                             f"got {self.tool_call_format!r}")
        check_name(name, "model_id", self.model_id)
        tenant, slash, model = self.model_id.partition("/")
        if not (tenant and slash and model):
            raise ValueError(f"{name}.model_id must be 'tenant/name', got {self.model_id!r}")
        object.__setattr__(self, "deployed_s", check_optional_seconds(name, "deployed_s", self.deployed_s))
        object.__setattr__(self, "max_model_len", check_count(name, "max_model_len", self.max_model_len, minimum=1,
                                                              optional=True))
        object.__setattr__(self, "max_queued_requests",
                           check_count(name, "max_queued_requests", self.max_queued_requests, minimum=1))
        object.__setattr__(self, "queue_timeout_s",
                           check_seconds(name, "queue_timeout_s", self.queue_timeout_s, positive=True))
        if not isinstance(self.instances, (tuple, list)) \
                or not all(isinstance(i, InstanceLoadRecord) for i in self.instances):
            raise ValueError(f"{name}.instances must be a list of InstanceLoadRecord, got {self.instances!r}")
        object.__setattr__(self, "instances", tuple(self.instances))

    @property
    def tenant(self) -> str:
        """The model's owner (the part of its id before the slash)."""
        return self.model_id.partition("/")[0]

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> ModelRecord:
        instances = values.get("instances", ())
        if not isinstance(instances, (list, tuple)):
            raise ValueError(f"{cls.record_name()}.instances must be a list, got {type(instances).__name__}")
        parsed = []
        for i, item in enumerate(instances):
            try:
                parsed.append(item if isinstance(item, InstanceLoadRecord) else InstanceLoadRecord.from_dict(item))
            except ValueError as exc:
                raise ValueError(f"{cls.record_name()}.instances[{i}]: {exc}") from None
        return super().from_fields({**values, "instances": tuple(parsed)})
