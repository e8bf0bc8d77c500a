"""Sleep, the other way to scale down, and waking, the first way to scale up: `InstanceSleep`.

Where memory is the slot (ARCHITECTURE.md, "Slot hosts"), an instance its model no longer needs
is put to sleep rather than stopped when it may (`may_sleep`: sleeping is on, it is ready and
idle, its node shares a worker memory budget and is not draining): its KV pool is freed, its
weights kept (on a GPU, moved to pinned host memory, as far as the node's host memory for
sleepers allows: `host_sleep_policy.room_for_sleeper`, whose longest-asleep are stopped to make
room). When its model wants instances again, sleepers wake before anything is placed, each
where its node still has the memory (and, off a GPU, the slot) for it; a sleeper whose node has
not is stopped, so that placement may put the model anywhere.

Split out of `controller.Controller`, whose tick calls `scale_down` and `wake` while converging
a model; it reads the controller's instances and nodes and carries out through `InstanceManager`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from controller.cluster_node import ClusterNode, has_worker_memory_budget
from controller.controller_config import ControllerConfig
from controller.host_sleep_policy import HostSleeper, SleeperRoom, room_for_sleeper
from controller.instance_manager import InstanceManager
from controller.managed_instance import ManagedInstance
from controller.model_state import ModelState
from controller.placement_policy import NodeView
from wire import InstanceState

__all__ = ["InstanceSleep"]


class InstanceSleep:
    """See the module docstring. `views(model, nodes, now)`: placement's view of those nodes for
    the model (the controller's, with other models' held slots taken out)."""

    def __init__(self, config: ControllerConfig, instances: InstanceManager, nodes: Mapping[str, ClusterNode], *,
                 views: Callable[[ModelState, list[ClusterNode], float], list[NodeView]]) -> None:
        self.config = config
        self._instances = instances
        self._nodes = nodes
        self._views = views

    def scale_down(self, instance: ManagedInstance, reason: str) -> None:
        """Its model wants one instance fewer: `instance` sleeps if it may and has room, else stops."""
        room = self._sleeper_room(instance) if self.may_sleep(instance) else None
        if room is not None and room.fits:
            for sleeper_id in room.dropped:  # the longest asleep, out of host memory
                sleeper = self._instances.get(sleeper_id)
                if sleeper is not None:
                    self._instances.begin_stop(sleeper, room.reason, 0.0, recycle=True)
            kept = "its weights moved to host memory" if instance.sleeps_to_host else "its weights kept"
            self._instances.begin_sleep(instance, f"{reason}; asleep rather than stopped, {kept}")
        else:
            why = f"{reason}; not asleep: {room.reason}" if room is not None else reason
            self._instances.begin_stop(instance, why, self.config.drain_timeout_s, recycle=True)

    def _sleeper_room(self, instance: ManagedInstance) -> SleeperRoom:
        """Whether `instance` may sleep beside its node's sleepers: always where its weights stay in
        its process; on a GPU (`sleeps_to_host`), as `room_for_sleeper` says of the node's host
        memory for sleepers (`ControllerConfig.sleep_host_bytes_per_gpu` per GPU)."""
        node = self._nodes.get(instance.node_id)
        if not instance.sleeps_to_host or node is None:
            return SleeperRoom(True, (), "its weights stay in its process")
        sleepers = [HostSleeper(i.instance_id, i.memory_bytes - i.kv_memory_bytes, i.asleep_s or 0.0)
                    for i in self._instances.all()
                    if i.node_id == node.node_id and i.phase is InstanceState.ASLEEP and i.sleeps_to_host]
        return room_for_sleeper(instance.instance_id, instance.memory_bytes - instance.kv_memory_bytes, sleepers,
                                self.config.sleep_host_bytes_per_gpu * node.num_gpus)

    def may_sleep(self, instance: ManagedInstance) -> bool:
        """An instance scaling down sleeps instead of stopping where its node shares a worker memory
        budget (`ControllerConfig.sleep_idle_instances`), it is ready and idle, and its node is not draining."""
        node = self._nodes.get(instance.node_id)
        return (self.config.sleep_idle_instances and node is not None and not node.draining
                and has_worker_memory_budget(node, self.config) and instance.phase is InstanceState.READY
                and instance.num_ongoing_requests == 0 and instance.handle is not None)

    def wake(self, model: ModelState, wanted: int, now: float, *, order: Sequence[str]) -> int:
        """Wakes up to `wanted` of the model's sleeping instances, tried in `order` (ids: the plan's
        `ModelPlan.wake_order`), whose node has the memory for their KV pools again; a sleeper whose
        node has not is stopped (its weights' memory freed, its process kept warm) so that placement
        may put the model anywhere. Returns how many woke."""
        asleep = {i.instance_id: i for i in self._instances.asleep(model.model_id)}
        sleepers = [asleep[i] for i in order if i in asleep]
        if not sleepers:
            return 0
        woken = 0
        nodes = [self._nodes[n] for n in sorted({i.node_id for i in sleepers}) if n in self._nodes]
        views = {v.node_id: v for v in self._views(model, nodes, now)}  # what other models' held slots leave
        for instance in sleepers:
            if woken == wanted:
                break
            view = views.get(instance.node_id)
            memory = instance.wake_memory_bytes  # its KV pool (and its weights, asleep in host memory)
            slots = 0 if instance.holds_slot else instance.num_worker_slots  # a GPU sleeper keeps its slot
            if view is None or view.free_memory_bytes is None or view.free_memory_bytes < memory \
                    or view.num_free_slots < slots:
                what = "its weights and KV pool" if instance.sleeps_to_host else "its KV pool"
                self._instances.begin_stop(instance, f"wanted again, but its node has no slot or no memory for "
                                           f"{what} now", 0.0, recycle=True)
                continue
            self._instances.begin_wake(instance, f"{model.model_id} has demand again")
            views[instance.node_id] = dataclasses.replace(  # what the next sleeper there is left
                view, free_memory_bytes=view.free_memory_bytes - memory, num_free_slots=view.num_free_slots - slots)
            woken += 1
        return woken
