"""What the controller knows about one deployed model besides its spec, between ticks.

Durable: the spec, the desired count (`num_desired_instances`, saved in the state store on
every change so a restarted controller resumes at the same scale) and when the model was deployed
(`deployed_s`; None only for a model deployed before the store kept it). Volatile, rebuilt after a
restart: the autoscaler's `AutoscaleState` (a lost one only makes the next move wait its delay
again), when a request was last seen, the gateways' queue reports, the model's size, the last
scale and placement decisions, the model's estimated restart time (`restart_s`, from the node
of its latest start; the keep-alive of a `keep_alive_per_restart` policy), and the back-off after failed starts. `record` is the model as the gateway reads it (`wire.ModelRecord`).

Queue reports are levels per reporter (one per gateway replica), not increments: a gateway
reports how many requests wait for the model now and how long the oldest of them has waited,
and repeats it while they wait. A report older than the TTL counts as zero, so a gateway that
died cannot hold a model up forever. `usage` counts the requests its instances started, decayed
with age: the frequency the eviction policy weighs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from controller.autoscale_policy import AutoscaleState
from controller.model_spec import ModelSpec
from controller.usage_meter import UsageMeter
from wire import InstanceLoadRecord, ModelRecord

DEFAULT_USAGE_HALF_LIFE_S = 300.0

MAX_START_BACKOFF_FACTOR = 32


@dataclass
class ModelState:
    spec: ModelSpec
    repository_name: str
    num_desired_instances: int
    num_bytes: int | None = None
    restart_s: float | None = None
    autoscale_state: AutoscaleState = field(default_factory=AutoscaleState)
    last_request_s: float | None = None
    # reporter -> (queued, oldest queued request's wait when reported, reported at)
    queue_reports: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    newest_waits: dict[str, float] = field(default_factory=dict)  # reporter -> its newest request's wait
    usage: UsageMeter = field(default_factory=lambda: UsageMeter(DEFAULT_USAGE_HALF_LIFE_S))
    last_scale: dict[str, Any] | None = None
    last_placement: dict[str, Any] | None = None
    num_failed_starts: int = 0
    next_start_s: float = 0.0
    deployed_s: float | None = None  # Unix time of the deploy; None when unknown (see the module docstring)

    @property
    def model_id(self) -> str:
        return self.spec.model_id

    @property
    def tool_call_format(self) -> str | None:
        """How the gateway reads the model's tool calls: the stored spec's parser, which a deploy
        resolved from "auto" (None: "none", or a spec stored before the field existed)."""
        parser = self.spec.tool_call_parser
        return None if parser in ("auto", "none") else parser

    def record(self, instances: Iterable[InstanceLoadRecord] = ()) -> ModelRecord:
        """The model as the gateway reads it, with its `instances` (how each was loaded)."""
        autoscaling = self.spec.autoscaling
        return ModelRecord(model_id=self.model_id, deployed_s=self.deployed_s, max_model_len=self.spec.max_model_len,
                           max_queued_requests=autoscaling.max_queued_requests,
                           queue_timeout_s=autoscaling.queue_timeout_s, instances=tuple(instances),
                           tool_call_format=self.tool_call_format)

    def report_queue(self, reporter: str, num_queued: int, now: float, oldest_wait_s: float = 0.0,
                     newest_wait_s: float = 0.0) -> None:
        """A gateway's queue length for the model now. Requests waiting are requests seen; so is
        a queue that got shorter: its requests went to an instance just now, before that
        instance's next load report can show them. Without that, a short keep-alive could scale
        the model to zero between the hand-over and the report, under the requests it was
        started for."""
        previous = self.queue_reports.get(reporter)
        self.queue_reports[reporter] = (num_queued, max(0.0, oldest_wait_s), now)
        self.newest_waits[reporter] = max(0.0, newest_wait_s)
        if num_queued > 0 or (previous is not None and previous[0] > num_queued):
            self.last_request_s = now

    def num_queued_requests(self, now: float, ttl_s: float) -> int:
        """Requests waiting at the gateways, from reports younger than `ttl_s`."""
        return sum(num for num, _, at in self.queue_reports.values() if now - at <= ttl_s)

    def newest_wait_s(self, now: float, ttl_s: float) -> float | None:
        """How long the newest request waiting at any gateway has waited by `now`: the one with the
        most time left before its deadline (None: none waits)."""
        return min((self.newest_waits.get(reporter, 0.0) + (now - at)
                    for reporter, (num, _, at) in self.queue_reports.items() if num > 0 and now - at <= ttl_s),
                   default=None)

    def oldest_wait_s(self, now: float, ttl_s: float) -> float:
        """How long the oldest request waiting at any gateway has waited by `now` (0: none waits)."""
        return max((oldest + (now - at) for num, oldest, at in self.queue_reports.values()
                    if num > 0 and now - at <= ttl_s), default=0.0)

    def start_failed(self, now: float, retry_delay_s: float) -> float:
        """Count a failed start; returns the back-off before the next one (doubling, capped)."""
        self.num_failed_starts += 1
        delay_s = retry_delay_s * min(MAX_START_BACKOFF_FACTOR, 2 ** (self.num_failed_starts - 1))
        self.next_start_s = now + delay_s
        return delay_s

    def start_succeeded(self) -> None:
        self.num_failed_starts = 0
        self.next_start_s = 0.0
