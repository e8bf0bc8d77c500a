"""How `RayGatewayBackend` follows the controller and admits requests: `RayBackendConfig`.

A frozen dataclass that validates itself (house rule 3), in a file of its own so the gateway
deployment's config can hold one without pulling in the backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RayBackendConfig:
    """How the gateway backend follows the controller and admits requests.

    Fields:
        long_poll_s: how long one ``routing_table`` call waits for a change before it returns
            the unchanged table. A change (an instance ready) comes back at once, so this does
            not add to a cold start; it bounds how stale the model list can get.
        retry_interval_s: pause after a failed refresh before the next try.
        max_ongoing_requests_per_instance: requests this gateway sends one instance at once;
            beyond it requests queue, which the controller sees as demand for more instances.
        retry_after_s: the Retry-After hint on 429 (queue full) and 503 (deadline passed) when
            the controller's outlook gives no estimate.
        max_retry_after_s: the longest Retry-After hint taken from an outlook's estimate.
        demand_report_interval_s: how often a non-empty queue is re-reported to the controller
            (it is also reported at once whenever its length changes); must be well under the
            controller's ``queue_report_ttl_s``. Each answer refreshes the model's outlook.
        progress_interval_s: how often a waiting request's `generate` yields a `QueueProgress`
            (the first one after this long in the queue).
        stale_after_s: without a successful refresh for this long, ``/readyz`` says not ready;
            longer than `long_poll_s`.
        call_timeout_s: how long ``/readyz`` and an uncached model's lookup wait on the controller.
        broken_instance_s: how long an instance that failed a request is skipped (unless the
            routing table drops it sooner).
        max_attempts: instances one request is tried on before it fails, counting those it is
            recovered on after an instance died mid-stream.
        unknown_model_ttl_s: how long a model name the controller did not know is answered 404
            without asking it again (0: ask every time); forgotten early once a refresh lists it.
    """

    long_poll_s: float = 5.0
    retry_interval_s: float = 0.5
    max_ongoing_requests_per_instance: int = 64
    retry_after_s: float = 1.0
    max_retry_after_s: float = 60.0
    demand_report_interval_s: float = 1.0
    progress_interval_s: float = 1.0
    stale_after_s: float = 15.0
    call_timeout_s: float = 5.0
    broken_instance_s: float = 10.0
    max_attempts: int = 3
    unknown_model_ttl_s: float = 3.0

    def __post_init__(self) -> None:
        for name in ("long_poll_s", "retry_interval_s", "retry_after_s", "max_retry_after_s",
                     "demand_report_interval_s", "progress_interval_s", "stale_after_s", "call_timeout_s",
                     "broken_instance_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"RayBackendConfig.{name} must be a finite number > 0, got {value!r}")
        for name in ("max_ongoing_requests_per_instance", "max_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RayBackendConfig.{name} must be an integer >= 1, got {value!r}")
        value = self.unknown_model_ttl_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"RayBackendConfig.unknown_model_ttl_s must be a finite number >= 0 (0: no caching of "
                             f"unknown model names), got {value!r}")
        if self.stale_after_s <= self.long_poll_s:
            raise ValueError(f"RayBackendConfig.stale_after_s ({self.stale_after_s:g}) must be longer than "
                             f"long_poll_s ({self.long_poll_s:g}), or an idle gateway would look stale")
