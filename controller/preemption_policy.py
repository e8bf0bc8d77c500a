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

With a deadline (`ttft_slo_s`, issue 39), a victim of the waiting model's own priority is also
kept unless the preemption raises the requests that meet their deadline: unless the waiting
model's newest queued request (the one with the most time left) can still get its first token
within `ttft_slo_s` of its arrival once the model has loaded on the victim's node. A victim of
lower priority goes after the bounded wait as before (priority stays a hard limit). So deadlines
only ever remove preemptions; weighing the waiter's gain against the victim's loss (its request
rate while it is out, its reload) to preempt before the bound is left for later: with a fixed
60 s keep-alive, preempting as soon as a deadline could be saved lowered seed 0's attainment
from 0.684 (no preemption) to 0.582. Past that, the
preemption saves none of the waiting model's queued requests and costs the victim's model its
slot, its next requests and a reload: under contention with loads longer than the deadline
(`thaw simulate --quick`, loads from S3 of up to minutes), preempting after the 5 s bound lowered
the mean SLO attainment over seeds 0-9 from 0.716 to 0.664.

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
                      free_slots_by_node: dict[str, int] | None = None, newest_wait_s: float | None = None,
                      ttft_slo_s: float | None = None) -> PreemptionDecision:
    """See the module docstring. `load_s_by_node`: the waiting model's time to ready per node it
    can go to; `free_slots_by_node`: slots already free there. `ttft_slo_s`: the waiting model's
    deadline (None: the bounded wait alone, for every priority); `newest_wait_s`: how long its
    newest queued request has waited (None: none is queued)."""
    if oldest_wait_s < max_wait_before_preempt_s:
        return PreemptionDecision(None, None, f"{waiting_model_id} has waited {oldest_wait_s:.3g}s of its "
                                              f"max_wait_before_preempt_s {max_wait_before_preempt_s:g}")
    slack_s = ttft_slo_s - newest_wait_s if ttft_slo_s is not None and newest_wait_s is not None else None  # time left
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
        elif ttft_slo_s is not None and c.priority == priority and \
                (slack_s is None or load_s_by_node[c.node_id] > slack_s):  # saves no deadline: moves the misses
            why = (f"of equal priority, and no request of {waiting_model_id} would meet its {ttft_slo_s:g}s "
                   f"deadline after the {load_s_by_node[c.node_id]:.3g}s load there" +
                   (f" (its newest has waited {newest_wait_s:.3g}s)" if newest_wait_s is not None else ""))
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
    why_now = f"waited {oldest_wait_s:.3g}s >= max_wait_before_preempt_s {max_wait_before_preempt_s:g}"
    if ttft_slo_s is not None and victim.priority == priority:
        why_now += (f", and its newest request, {newest_wait_s:.3g}s waited, can still meet its {ttft_slo_s:g}s "
                    f"deadline after the {load_s_by_node[victim.node_id]:.3g}s load")
    return PreemptionDecision(victim, victim.action, (
        f"preempt {victim.instance_id} ({victim.model_id}, priority {victim.priority}, ready "
        f"{victim.ready_for_s:.3g}s) on {victim.node_id} for {waiting_model_id} (priority {priority}, "
        f"{why_now}): {how}"))
