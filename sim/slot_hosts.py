"""The cluster's GPUs as slot hosts (`ClusterSpec.models_per_gpu` above 1): where each hosted
instance sits, what room that leaves a model, sleep and wake, and the GPUs' time in use.

One `SlotHosts` per `SimCluster` that has slot hosts; the cluster calls it at each start, stop,
sleep and wake of an instance on a node with hosts (`SimNode.hosts`, one `sim.sim_host.SimHost`
per GPU) and asks it for room, so the policies' slot counts are memory-aware:

- an instance's share of each of its GPUs is its weights plus a `kv_pool_tokens` KV pool, over its
  tensor-parallel degree (`CostModel.instance_memory_bytes`); it takes `num_slots` GPUs of one node
  that fit it, best fit (`sim.sim_host.best_fit`);
- `room(node, model)`: the node's GPUs that fit one more share of the model; `freed_for`: what
  stopping an instance adds to that (0 where its GPU fits the model already);
- sleep (the controller's `InstanceSleep`, ARCHITECTURE.md "Slot hosts"): an idle instance its
  model scales down gives its GPUs' memory back and keeps its places, its weights waiting in
  pinned host memory (`sleep_capacity_per_gpu` per GPU on the node for all its sleepers:
  `controller.room_for_sleeper` decides, the policy carries out); a wake takes the memory back and
  serves after `CostModel.wake_s`, a copy over each GPU's own link;
- accounting: a GPU is one accelerator-second per second while an awake instance is on it,
  however many; sleepers cost host memory, not the GPU.
"""

from __future__ import annotations

import heapq

from sim.sim_host import best_fit, others_s, prefill_taken, reshare

__all__ = ["SlotHosts"]

GIB = 1 << 30


class SlotHosts:
    """See the module docstring. `models`: the cluster's `SimModelState`s, in catalog order."""

    def __init__(self, spec, models, cost, gpu) -> None:
        if gpu is None or not hasattr(cost, "instance_memory_bytes"):
            raise ValueError("slot hosts (ClusterSpec.models_per_gpu > 1) are modelled on a GPU kind's memory: "
                             "run them with a GPU cost model, not a measured CPU profile")
        self.spec = spec
        self.share_bytes: list[int] = []  # per model: what an instance takes of each of its GPUs
        self.wake_s: list[float] = []  # per model: a sleeper's wake
        for state in models:
            share = cost.instance_memory_bytes(state.model, gpu, spec.kv_pool_tokens)
            if share > spec.gpu_memory_bytes:
                raise ValueError(f"model {state.model_id} takes {share / GIB:.1f} GiB of each of its GPUs (weights "
                                 f"and a {spec.kv_pool_tokens}-token KV pool), more than the slot host's "
                                 f"{spec.gpu_memory_bytes / GIB:.1f} GiB: lower kv_pool_tokens")
            self.share_bytes.append(share)
            self.wake_s.append(cost.wake_s(state.model, gpu))
        self._roomiest: dict[int, int] = {}  # node index -> free bytes of its roomiest GPU with a place
        self.accelerator_s = 0.0  # GPU-seconds in use, of GPUs no longer in use
        self.num_in_use = 0  # GPUs with an awake instance now
        self.sleep_capacity_bytes = spec.sleep_capacity_per_gpu * spec.gpus_per_node  # per node

    # --- room ----------------------------------------------------------------------------------

    def room(self, node, model_index: int) -> int:
        share = self.share_bytes[model_index]
        return sum(1 for host in node.hosts if host.fits(share))

    def freed_for(self, instance, model_index: int) -> int:
        """What stopping `instance` adds to `room(its node, model_index)`: its GPUs that the
        model's share does not fit now and would once it left (its place, and its memory if awake)."""
        share = self.share_bytes[model_index]
        leaving = 0 if instance.asleep_s is not None else self.share_bytes[instance.model_index]
        return sum(1 for host in instance.hosts if not host.fits(share) and host.fits_once_gone(share, leaving))

    def nodes_with_room(self, nodes, model_index: int, limit: int, now: float) -> list:
        """Up to `limit` of `nodes` whose roomiest GPU with a free place fits the model's share:
        those whose disk and network loader is free soonest first, then the roomiest, then the
        lower index. Packed GPUs leave many nodes with room, and what sets their estimates apart
        is then the loader a repository fetch waits for, not their free GPUs (for a model on k
        GPUs a candidate, not a promise: `room` says how many fit)."""
        share = self.share_bytes[model_index]
        roomiest = self._roomiest
        keys = [(node.loader_wait_s(now), -roomiest.get(node.index, self.spec.gpu_memory_bytes), node.index)
                for node in nodes if roomiest.get(node.index, self.spec.gpu_memory_bytes) >= share]
        return [nodes[key[2]] for key in heapq.nsmallest(limit, keys)]

    def refresh(self, node) -> int:
        """After a change on `node`'s GPUs: its roomiest GPU remembered, and its GPUs with a free
        place returned (the cluster's coarse index of nodes with room)."""
        self._roomiest[node.index] = max((h.free_bytes for h in node.hosts if h.free_places), default=-1)
        return sum(1 for host in node.hosts if host.free_places)

    # --- starts and stops ----------------------------------------------------------------------

    def place(self, instance, node, now: float) -> None:
        """A starting instance takes its GPUs of `node` (best fit) and its share of each."""
        share = self.share_bytes[instance.model_index]
        instance.hosts = best_fit(node.hosts, share, instance.num_slots)
        for host in instance.hosts:
            if host.take(instance, share, now):
                self.num_in_use += 1
        self._join(instance)

    def remove(self, instance, now: float) -> None:
        """A stopped instance (awake or asleep) leaves its GPUs."""
        share = self.share_bytes[instance.model_index]
        hosts, instance.hosts = instance.hosts, ()
        self._leave(instance)
        for host in hosts:
            self._count(host.give_back(instance, share, now, awake=instance.asleep_s is None))
        reshare(hosts, instance, now)

    # --- sleep and wake ------------------------------------------------------------------------

    def sleep(self, instance, now: float) -> None:
        """An idle instance gives its GPUs' memory back and keeps its places."""
        share = self.share_bytes[instance.model_index]
        instance.asleep_s = now
        self._leave(instance)
        for host in instance.hosts:
            self._count(host.doze(share, now))

    def can_wake(self, instance) -> bool:
        share = self.share_bytes[instance.model_index]
        return all(host.free_bytes >= share for host in instance.hosts)  # its places are its own

    def wake(self, instance, now: float) -> float:
        """A sleeper takes its memory back; returns the seconds until it serves (`CostModel.wake_s`)."""
        share = self.share_bytes[instance.model_index]
        instance.asleep_s = None
        for host in instance.hosts:
            if host.rouse(share, now):
                self.num_in_use += 1
        self._join(instance)
        return self.wake_s[instance.model_index]

    # --- accounting ----------------------------------------------------------------------------

    def close(self, nodes, now: float) -> float:
        """GPU-seconds of the GPUs still in use at the end of the run (added to `accelerator_s`)."""
        return sum(now - host.occupied_since_s for node in nodes for host in node.hosts
                   if host.occupied_since_s is not None)

    def _count(self, used_s: float | None) -> None:
        if used_s is not None:
            self.accelerator_s += used_s
            self.num_in_use -= 1

    @staticmethod
    def _join(instance) -> None:
        """An awake instance takes turns with its neighbours (`sim.sim_host`)."""
        instance.others_s = others_s(instance)
        instance.on_step = lambda changed, at: reshare(changed.hosts, changed, at)
        instance.on_prefill = prefill_taken

    @staticmethod
    def _leave(instance) -> None:
        instance.on_step = None
        instance.on_prefill = None
