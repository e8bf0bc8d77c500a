"""How a platform shares its slots between models: `SlotSharingSettings` (part of `ControllerConfig`).

Frozen and validated; the policies it tunes are pure functions in their own modules
(`eviction_policy`, `preemption_policy`, `slot_queue_policy`), carried out by `SlotSharer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from controller.eviction_policy import EvictionSettings
from controller.slot_queue_policy import DEFAULT_PRIORITY_BOOST_S


def _seconds(name: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"SlotSharingSettings.{name} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SlotSharingSettings:
    """Fields:
        eviction: when and which idle instances give up their slot (`EvictionSettings`).
        preempt: whether a busy instance may be preempted (migrated off or suspended) for a
            model that waited its `max_wait_before_preempt_s`; False: waiting models only get
            free slots and idle instances.
        deadline_preemption: a busy instance of the waiting model's own priority is preempted only
            when that saves a queued request's first-token deadline (the spec's `ttft_slo_s`; see
            `preemption_policy`), a lower-priority one after the bounded wait; False: every
            priority after the bounded wait (as before issue 39).
        deadline_eviction: an idle instance is evicted only for a waiting model with a queued
            request that can still meet its first-token deadline after the load there, or one
            whose oldest request has waited `eviction.lost_wait_s` (see `eviction_policy`);
            False: for any waiting model (as before issue 39).
        deadline_order: waiting models get slots by deadline slack, those whose requests can still
            meet their first-token deadline first (`slot_queue_policy`); False: by oldest request
            alone (as before issue 39).
        starvation_bound_s: with `deadline_order`, a model whose oldest request has waited this
            long is served by age, ahead of the deadline order: the longest that order passes a
            model over.
        contended_keep_alive_s: while some model has found no free slot within this long, no idle
            instance is given back by its keep-alive before it has been idle this long
            (`LoadSnapshot.keep_alive_floor_s`; the eviction policy may still take it for a
            waiting model). 0 (the default, which suits CPU nodes whose restarts take seconds):
            off; `thaw simulate` deploys its GPU cluster with 60 (`sim.policies.THAW_SHARING`).
        min_run_s: an instance is preempted only after serving at least this long (the least
            quantum two contending models get), and at least as long as the waiting model's load
            on its node takes (`choose_preemption`).
        priority_boost_s: how many seconds of waiting one priority step is worth in the order
            waiting models get slots (`slot_queue_policy`).
        suspend_timeout_s: how long the controller waits for a worker to hand back the requests
            it suspends (their KV parked, or their streams ended).
        max_parked_kv_bytes: node memory the controller may hold for suspended requests' KV (Ray's
            object store); a request whose KV does not fit is suspended by its tokens (its KV
            recomputed when it resumes). 0: always by tokens.
    """

    eviction: EvictionSettings = field(default_factory=EvictionSettings)
    preempt: bool = True
    deadline_preemption: bool = True
    deadline_eviction: bool = True
    deadline_order: bool = True
    starvation_bound_s: float = 300.0
    contended_keep_alive_s: float = 0.0
    min_run_s: float = 2.0
    priority_boost_s: float = DEFAULT_PRIORITY_BOOST_S
    suspend_timeout_s: float = 10.0
    max_parked_kv_bytes: int = 1 << 30

    def keep_alive_floor_s(self, no_room_s: float | None, now: float) -> float:
        """The least keep-alive at `now` when a model with queued requests last found no free slot
        at `no_room_s` (None: never): `contended_keep_alive_s` within that long, else 0. The one
        rule the controller's `SlotSharer` and the simulator's Thaw policy both apply."""
        if not self.contended_keep_alive_s or no_room_s is None or now - no_room_s > self.contended_keep_alive_s:
            return 0.0
        return self.contended_keep_alive_s

    def __post_init__(self) -> None:
        if not isinstance(self.eviction, EvictionSettings):
            raise ValueError(f"SlotSharingSettings.eviction must be an EvictionSettings, "
                             f"got {type(self.eviction).__name__}")
        if not isinstance(self.preempt, bool):
            raise ValueError(f"SlotSharingSettings.preempt must be True or False, got {self.preempt!r}")
        if not isinstance(self.deadline_preemption, bool):
            raise ValueError(f"SlotSharingSettings.deadline_preemption must be True or False, "
                             f"got {self.deadline_preemption!r}")
        if not isinstance(self.deadline_eviction, bool):
            raise ValueError(f"SlotSharingSettings.deadline_eviction must be True or False, "
                             f"got {self.deadline_eviction!r}")
        if not isinstance(self.deadline_order, bool):
            raise ValueError(f"SlotSharingSettings.deadline_order must be True or False, got {self.deadline_order!r}")
        for name in ("starvation_bound_s", "contended_keep_alive_s", "min_run_s", "priority_boost_s", "suspend_timeout_s"):
            object.__setattr__(self, name, _seconds(name, getattr(self, name)))
        if not isinstance(self.max_parked_kv_bytes, int) or isinstance(self.max_parked_kv_bytes, bool) \
                or self.max_parked_kv_bytes < 0:
            raise ValueError(f"SlotSharingSettings.max_parked_kv_bytes must be an integer >= 0, "
                             f"got {self.max_parked_kv_bytes!r}")
