"""In which order models waiting for a slot get one: by deadline slack, else oldest request first,
weighted by priority.

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

With deadlines (issue 39; `starvation_bound_s` given, and a model's `ttft_slo_s`, `newest_wait_s`
and `load_s` known) the order has three classes, in turn:

1. models whose oldest request has waited `starvation_bound_s` or more, by effective wait as above
   (the deadline order passes a model over for that long at most);
2. models whose newest queued request can still meet its first-token deadline once the model has
   loaded (its *slack*, `ttft_slo_s - newest_wait_s - load_s`, >= 0), least slack first, each
   priority step worth `priority_boost_s` of slack; earliest deadline first is what meets the most
   deadlines when not all can be met at once;
3. the rest (their requests are past saving, or a figure is unknown), by effective wait.

A slot therefore goes to a request it can still save before one it cannot (in `thaw simulate`'s
contended scenario a model whose requests had waited out a one-minute repository load took the
slot a popular model's fresh request could have been served in within its deadline; a bound of
60 s, the eviction's `lost_wait_s`, put most of those models back ahead, as their loads take
longer, and lost the gain: hence its own, longer default). The bound above still holds with
W + `starvation_bound_s` for W: a model that has waited `starvation_bound_s` is in the first
class, which no model outside it overtakes, and ordered there as before.

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
    """A model with requests waiting for an instance, as one tick sees it.

    Fields:
        oldest_wait_s / newest_wait_s: how long its oldest and newest queued requests have waited
            (newest None: not known).
        load_s: its soonest time to ready on any node it may go to (placement's estimate; None:
            not known).
        ttft_slo_s: its first-token deadline (the spec's `ttft_slo_s`; None: none).
    """

    model_id: str
    oldest_wait_s: float
    priority: int = 0
    num_queued_requests: int = 1
    newest_wait_s: float | None = None
    load_s: float | None = None
    ttft_slo_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"{self.model_id}: priority must be an integer, got {self.priority!r}")
        if not isinstance(self.oldest_wait_s, (int, float)) or isinstance(self.oldest_wait_s, bool) \
                or not math.isfinite(self.oldest_wait_s) or self.oldest_wait_s < 0:
            raise ValueError(f"{self.model_id}: oldest_wait_s must be a finite number >= 0, got {self.oldest_wait_s!r}")
        for name in ("newest_wait_s", "load_s", "ttft_slo_s"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not math.isfinite(value) or value < 0):
                raise ValueError(f"{self.model_id}: {name} must be a finite number >= 0 or None, got {value!r}")

    def slack_s(self) -> float | None:
        """Seconds its newest request would have left before its deadline once the model has
        loaded (negative: past saving; None: a figure is unknown)."""
        if self.ttft_slo_s is None or self.newest_wait_s is None or self.load_s is None:
            return None
        return self.ttft_slo_s - self.newest_wait_s - self.load_s


def effective_wait_s(model: WaitingModel, priority_boost_s: float = DEFAULT_PRIORITY_BOOST_S) -> float:
    return model.oldest_wait_s + model.priority * priority_boost_s


def order_waiting(models: Sequence[WaitingModel], priority_boost_s: float = DEFAULT_PRIORITY_BOOST_S,
                  starvation_bound_s: float | None = None) -> list[WaitingModel]:
    """The waiting models, first to be served first (see the module docstring). `starvation_bound_s`
    None: by effective wait alone, whatever the deadlines."""
    if not math.isfinite(priority_boost_s) or priority_boost_s < 0:
        raise ValueError(f"priority_boost_s must be a finite number >= 0, got {priority_boost_s!r}")
    if starvation_bound_s is not None and (not math.isfinite(starvation_bound_s) or starvation_bound_s < 0):
        raise ValueError(f"starvation_bound_s must be a finite number >= 0 or None, got {starvation_bound_s!r}")

    def key(model: WaitingModel) -> tuple[int, float, str]:
        if starvation_bound_s is not None and model.oldest_wait_s < starvation_bound_s:
            slack = model.slack_s()
            if slack is not None and slack >= 0:
                return (1, slack - model.priority * priority_boost_s, model.model_id)
            return (2, -effective_wait_s(model, priority_boost_s), model.model_id)
        return (0, -effective_wait_s(model, priority_boost_s), model.model_id)

    return sorted(models, key=key)
