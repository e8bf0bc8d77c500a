"""In which order models waiting for a slot get one: oldest request first, weighted by priority.

When more models wait than slots come free, the controller serves them in this order (each
tick, and each freed slot, goes to the head of the line first). The key of a waiting model is its
*effective wait*:

    effective_wait_s = oldest_wait_s + priority x priority_boost_s

where `oldest_wait_s` is how long its oldest queued request has waited (the gateways report
it) and `priority` the spec's integer. Largest first; ties go to the smaller model id, so the
order never depends on the input's.

Why it cannot starve (the bound): effective waits of all waiting models grow at the same rate
(one second per second), and a model is overtaken only by models whose effective wait is larger.
A model M that started waiting at time t is therefore served before every model that started
waiting after t + (p_max - p_M) x priority_boost_s, where p_max is the highest priority among
them. So once M has waited W = (p_max - p_M) x priority_boost_s, only models that were already
waiting before that can still be ahead of it: with K models waiting and a slot freed at least
every T seconds (an instance finishing or being preempted, `max_wait_before_preempt_s` plus a
load), M gets a slot within W + K x T. Equal priorities make it plain FIFO by oldest request.

A pure function of plain values; `tests/controller/test_slot_queue_policy.py` checks the order
and the bound by replaying arrivals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_PRIORITY_BOOST_S", "WaitingModel", "effective_wait_s", "order_waiting"]

DEFAULT_PRIORITY_BOOST_S = 10.0  # one priority step is worth this many seconds of waiting


@dataclass(frozen=True, kw_only=True)
class WaitingModel:
    """A model with requests waiting for an instance, as one tick sees it."""

    model_id: str
    oldest_wait_s: float
    priority: int = 0
    num_queued_requests: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"{self.model_id}: priority must be an integer, got {self.priority!r}")
        if not isinstance(self.oldest_wait_s, (int, float)) or isinstance(self.oldest_wait_s, bool) \
                or not math.isfinite(self.oldest_wait_s) or self.oldest_wait_s < 0:
            raise ValueError(f"{self.model_id}: oldest_wait_s must be a finite number >= 0, got {self.oldest_wait_s!r}")


def effective_wait_s(model: WaitingModel, priority_boost_s: float = DEFAULT_PRIORITY_BOOST_S) -> float:
    return model.oldest_wait_s + model.priority * priority_boost_s


def order_waiting(models: Sequence[WaitingModel],
                  priority_boost_s: float = DEFAULT_PRIORITY_BOOST_S) -> list[WaitingModel]:
    """The waiting models, first to be served first (see the module docstring)."""
    if not math.isfinite(priority_boost_s) or priority_boost_s < 0:
        raise ValueError(f"priority_boost_s must be a finite number >= 0, got {priority_boost_s!r}")
    return sorted(models, key=lambda m: (-effective_wait_s(m, priority_boost_s), m.model_id))
