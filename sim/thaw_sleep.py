"""Thaw's sleep and wake on the simulated slot hosts: the steps of the controller's `InstanceSleep`.

- `scale_down`: an instance its model no longer needs sleeps instead of stopping where it may (it
  is on slot hosts, ready and idle, and sleeping is on): as far as its node's host memory for
  sleepers allows, `controller.room_for_sleeper` deciding which of the longest asleep there are
  stopped first to make room; otherwise it stops.
- `wake`: when its model wants instances again, sleepers wake before anything is placed, each
  where its GPUs have the memory for it again; one whose GPUs have not is stopped, so that
  placement may put the model anywhere (the controller's rule).

Sleepers are eviction candidates too (`eviction_candidate` builds theirs): on a GPU a sleeper
holds no device memory but its place in the slot host, which evicting it frees.
"""

from __future__ import annotations

from controller import EvictionCandidate, HostSleeper, room_for_sleeper
from wire import InstanceState

__all__ = ["eviction_candidate", "scale_down", "wake"]


def scale_down(cluster, instance, *, sleep: bool) -> str:
    """Sleep or stop `instance`; returns "slept" or "stopped"."""
    if sleep and instance.hosts and instance.phase == InstanceState.READY and not instance.num_ongoing:
        node = cluster.nodes[instance.node_index]
        weight_bytes = cluster.models[instance.model_index].model.weight_bytes
        sleepers = list(node.sleepers.values())
        room = room_for_sleeper(instance.instance_id, weight_bytes,
                                [HostSleeper(s.instance_id, cluster.models[s.model_index].model.weight_bytes,
                                             s.asleep_s) for s in sleepers],
                                cluster.hosts.sleep_capacity_bytes)
        if room.fits:
            by_id = {s.instance_id: s for s in sleepers}
            for sleeper_id in room.dropped:  # the longest asleep, out of host memory
                cluster.stop_instance(by_id[sleeper_id])
            cluster.sleep(instance)
            return "slept"
    cluster.stop_instance(instance)
    return "stopped"


def wake(cluster, state, wanted: int, *, order) -> int:
    """Wakes up to `wanted` of the model's sleepers, tried in `order` (ids: the plan's
    `ModelPlan.wake_order`); returns how many woke."""
    woken = 0
    by_id = {s.instance_id: s for s in state.sleepers}
    for sleeper in [by_id[i] for i in order if i in by_id]:
        if woken == wanted:
            break
        if cluster.hosts.can_wake(sleeper):
            cluster.wake(sleeper)
            woken += 1
        else:
            cluster.stop_instance(sleeper)  # wanted again where its GPUs lack the memory now
    return woken


def eviction_candidate(cluster, sleeper, waiting_model_index: int, now: float, *, reload_s: float,
                       reload_tier: str, frequency: float, priority: int) -> EvictionCandidate | None:
    """A sleeper as an eviction candidate for the waiting model (None: evicting it frees no room
    for it: its GPU's memory, not its place, is what the model lacks there)."""
    freed = cluster.slots_freed_for(sleeper, waiting_model_index)
    if not freed:
        return None
    owner = cluster.models[sleeper.model_index]
    return EvictionCandidate(
        instance_id=sleeper.instance_id, model_id=owner.model_id, node_id=cluster.nodes[sleeper.node_index].node_id,
        num_worker_slots=freed, ready=False, asleep=True, holds_slot=True, num_ongoing_requests=0,
        num_queued_requests=len(owner.queue), idle_s=max(0.0, now - sleeper.asleep_s),
        num_model_instances=len(owner.instances), min_instances=0, priority=priority, frequency=frequency,
        reload_s=reload_s, reload_tier=reload_tier)
