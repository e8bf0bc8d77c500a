"""`EngineGauges`: one ready instance's engine load, as the gateways export it on ``/metrics``.

The controller polls every worker's `InstanceStats`; the gateways, which serve ``/metrics``, ask the
controller for this summary of the latest ones (controller -> gateway), so one scrape of any gateway
replica shows every node's engines: running and waiting requests and KV-cache use (the gauges vLLM
users chart as ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from wire.wire_record import WireRecord, check_count, check_name

__all__ = ["EngineGauges"]


@dataclass(frozen=True)
class EngineGauges(WireRecord):
    """Fields: the instance, its model and logical node; its engine's running and waiting requests
    and the fraction of its KV blocks in use (0..1), as last reported to the controller."""

    SCHEMA: ClassVar[str] = "engine_gauges/1"

    instance_id: str
    model_id: str
    node_id: str
    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float

    def __post_init__(self) -> None:
        name = self.record_name()
        check_name(name, "instance_id", self.instance_id)
        check_name(name, "model_id", self.model_id)
        if not isinstance(self.node_id, str):
            raise ValueError(f"{name}.node_id must be a string, got {self.node_id!r}")
        for field in ("num_running_requests", "num_waiting_requests"):
            object.__setattr__(self, field, check_count(name, field, getattr(self, field)))
        usage = self.kv_cache_usage
        if not isinstance(usage, (int, float)) or isinstance(usage, bool) or not math.isfinite(usage) \
                or not 0.0 <= usage <= 1.0:
            raise ValueError(f"{name}.kv_cache_usage must be a fraction in 0..1, got {usage!r}")
        object.__setattr__(self, "kv_cache_usage", float(usage))
