"""When every slot is busy and a model has waited too long: which busy instance to preempt, and how.

A model whose oldest request has waited `max_wait_before_preempt_s` (its spec) while no slot is
free and no idle instance could be evicted may take a busy instance's slot, from a model of
equal or lower priority (never higher: priority is a hard limit):

- if the victim's model has another ready instance, its requests live-migrate there
  (`action="migrate"`: nobody pauses; the same move as a slot reclaim);
- otherwise its in-flight requests are *suspended* (`action="suspend"`): they leave the
  instance with what they have generated so far, wait for their model's next slot like any
  queued request, and continue there from the tokens their clients already hold (greedy output
  is exactly an uninterrupted run's; the client sees a pause, never an error).

Order: lowest priority first; then a migration before a suspension (nobody waits); then the
fewest requests to move; then the instance that has held its slot longest; then the smaller id.
A victim must have been ready at least `min_run_s`, and at least as long as the waiting model would
take to load on its node: two contending models then alternate in quanta of at least that (plus
their `max_wait_before_preempt_s`) rather than thrash, and however slow the storage, a contended
slot spends at most about half its time loading. (A fixed quantum of 2 s, against loads of 40-190 s
from S3 in the cluster simulator, kept slots loading most of the time: `thaw simulate`, issue 24.)

Never preempted: a loading or stopping instance, one on a draining node, one of a model with a
higher priority than the waiting one, one whose node the waiting model cannot be placed on, one
too small to free the slots needed. A pure function of plain values: tested with numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PreemptionCandidate", "PreemptionDecision", "choose_preemption"]


@dataclass(frozen=True, kw_only=True)
class PreemptionCandidate:
    """A busy instance that might be preempted.

    Fields:
        instance_id / model_id / node_id: which, of which model, where.
        num_worker_slots: the slots it occupies.
        ready: READY (not loading or stopping).
        num_ongoing_requests: requests to move or suspend.
        ready_for_s: how long it has been ready (held its slot serving).
        priority: its model's priority.
        destination_instance_id: another ready instance of its model that can take its requests
            (`choose_destination`), None if there is none.
        draining: its node is draining.
    """

    instance_id: str
    model_id: str
    node_id: str
    num_worker_slots: int = 1
    ready: bool = True
    num_ongoing_requests: int = 0
    ready_for_s: float = 0.0
    priority: int = 0
    destination_instance_id: str | None = None
    draining: bool = False

    @property
    def action(self) -> str:
        return "migrate" if self.destination_instance_id is not None else "suspend"


@dataclass(frozen=True)
class PreemptionDecision:
    """The instance to preempt and how (`action` "migrate" or "suspend"), or None with the reason."""

    victim: PreemptionCandidate | None
    action: str | None
    reason: str


def choose_preemption(waiting_model_id: str, *, priority: int, oldest_wait_s: float,
                      max_wait_before_preempt_s: float, candidates: Sequence[PreemptionCandidate],
                      load_s_by_node: dict[str, float], min_run_s: float, num_slots: int = 1,
                      free_slots_by_node: dict[str, int] | None = None) -> PreemptionDecision:
    """See the module docstring. `load_s_by_node`: the waiting model's time to ready per node it
    can go to; `free_slots_by_node`: slots already free there."""
    if oldest_wait_s < max_wait_before_preempt_s:
        return PreemptionDecision(None, None, f"{waiting_model_id} has waited {oldest_wait_s:.3g}s of its "
                                              f"max_wait_before_preempt_s {max_wait_before_preempt_s:g}")
    free = free_slots_by_node or {}
    eligible, kept = [], []
    for c in candidates:
        if c.model_id == waiting_model_id:
            continue
        why = None
        if c.draining:
            why = "its node drains"
        elif not c.ready:
            why = "not ready"
        elif c.priority > priority:
            why = f"priority {c.priority} > {priority}"
        elif c.node_id not in load_s_by_node:
            why = f"{waiting_model_id} cannot be placed on its node"
        elif c.ready_for_s < min_run_s:
            why = f"ready only {c.ready_for_s:.3g}s < min_run_s {min_run_s:g}"
        elif c.ready_for_s < load_s_by_node[c.node_id]:
            why = (f"ready only {c.ready_for_s:.3g}s < the {load_s_by_node[c.node_id]:.3g}s {waiting_model_id} "
                   f"needs to load there")
        elif free.get(c.node_id, 0) + c.num_worker_slots < num_slots:
            why = f"frees {c.num_worker_slots} of the {num_slots} slots needed"
        if why is not None:
            kept.append(f"{c.instance_id} ({c.model_id}): {why}")
            continue
        eligible.append(c)
    if not eligible:
        return PreemptionDecision(None, None, "nothing to preempt: " + ("; ".join(kept) or "no other model holds a slot"))
    victim = min(eligible, key=lambda c: (c.priority, c.action != "migrate", c.num_ongoing_requests,
                                          -c.ready_for_s, c.instance_id))
    how = (f"migrate its {victim.num_ongoing_requests} request(s) to {victim.destination_instance_id}"
           if victim.action == "migrate" else f"suspend its {victim.num_ongoing_requests} request(s) until "
                                              f"{victim.model_id} gets a slot again")
    return PreemptionDecision(victim, victim.action, (
        f"preempt {victim.instance_id} ({victim.model_id}, priority {victim.priority}, ready "
        f"{victim.ready_for_s:.3g}s) on {victim.node_id} for {waiting_model_id} (priority {priority}, waited "
        f"{oldest_wait_s:.3g}s >= max_wait_before_preempt_s {max_wait_before_preempt_s:g}): {how}"))
