"""The background work of the simulated nodes: spare workers and DRAM promotion (`NodeUpkeep`).

Two things the controller does on a node once it has *settled* -- no instance there loading, and
none ready for less than `ClusterSpec.settle_s` (`Controller._settling_instances`: background
work would compete with a cold start for the node's CPUs):

- spare workers (`controller.spare_pool`): each node keeps `spare_workers_per_node` worker
  processes started ahead of demand. A start takes a warm one when there is one (it then costs
  `start_overhead_s` beyond its read) and otherwise starts a process (`process_start_s` more).
  A settled node with fewer spares (warm or starting) than its quota starts one, offered
  `spare_warm_s` later. An instance that came from a spare and is stopped to give its slot
  away (evicted or preempted) goes back to the pool when it has room (`SparePool.adopt`).
- DRAM promotion (`controller.checkpoint_copies`, with `ClusterSpec.promote_on_settle`): a start
  reads the SSD directly, so the DRAM copy of a model its ready instances read from SSD (or the
  repository, through the SSD) -- and of one evicted before it was promoted -- is made once the
  node has settled, landing one SSD read later. Without `promote_on_settle` the cluster copies
  into DRAM at once when an instance is ready (the simulator's first model).

The controller looks at every reconcile tick; here a node is looked at when something that
changes its settling happens (an instance ready, one gone), when its settling time runs out, and
when an instance there is stopped for another model (the same tick's look, before the victim's
worker is back: see `stopping_for_another`).
Off (no spares, no promotion) it costs nothing: the cluster's scale runs never call it.
"""

from __future__ import annotations
from wire import InstanceState


__all__ = ["NodeUpkeep"]

_SSD_READ_TIERS = ("ssd", "s3")  # a start from the repository reads the copy fetched to SSD
LOOK_PRIORITY = 3  # after the tick scheduler's ticks (2) at the same instant


class NodeUpkeep:
    """Spare pools and DRAM promotions of `cluster`'s nodes (see the module docstring)."""

    def __init__(self, cluster) -> None:
        spec = cluster.spec
        self.cluster = cluster
        self.per_node = spec.spare_workers_per_node
        self.promote_on_settle = spec.promote_on_settle
        self.enabled = self.per_node > 0 or self.promote_on_settle
        num_nodes = len(cluster.nodes)
        self.num_warm = [self.per_node] * num_nodes  # the platform starts with its spares warm
        self.num_starting = [0] * num_nodes
        self._wanted: list[set[int]] = [set() for _ in range(num_nodes)]  # evicted before promoted
        self._promoting: list[set[int]] = [set() for _ in range(num_nodes)]
        self.counts = {"starts_from_spare": 0, "spares_started": 0, "spares_recycled": 0, "dram_promotions": 0}

    # --- what the cluster asks and tells -------------------------------------------------------

    def take_spare(self, node) -> bool:
        """A start on `node`: True if it takes a warm spare (the pool forgets it)."""
        if self.num_warm[node.index] <= 0:
            return False
        self.num_warm[node.index] -= 1
        self.counts["starts_from_spare"] += 1
        return True

    def would_recycle(self, instance, node) -> bool:
        """Whether `instance`'s worker goes back to the pool when it is gone (as `released` decides)."""
        index = node.index
        return instance.recycle and instance.from_spare \
            and self.num_warm[index] + self.num_starting[index] < self.per_node

    def released(self, instance, node) -> None:
        """`instance` is gone from `node`: its spare's process back to the pool when it was stopped
        to give its slot away and the pool has room; the node may have settled."""
        index = node.index
        if self.would_recycle(instance, node):
            self.num_warm[index] += 1
            self.counts["spares_recycled"] += 1
        self.look_at(node)

    def stopping_for_another(self, instance, node) -> None:
        """`instance` is being stopped so another model gets its slot (evicted or preempted): a copy
        it read from SSD is wanted in DRAM (`keep_in_dram`), and the node is looked at once this
        tick is over, before the victim's worker is back: the controller's tick that decided the
        stop runs its spare and promotion steps before the victim has drained, so a settled node
        starts a new spare then, and the victim's process, finding the pool full, is ended rather
        than recycled."""
        if not self.enabled:
            return
        if self.promote_on_settle and instance.tier in _SSD_READ_TIERS:
            self._wanted[node.index].add(instance.model_index)
        self.look_at(node)

    def ready(self, instance, node) -> None:
        """An instance on `node` became ready: look again once it has been ready `settle_s`."""
        self.look_at(node, self.cluster.loop.now + self.cluster.spec.settle_s)

    # --- the node's settling -------------------------------------------------------------------

    def look_at(self, node, at_s: float | None = None) -> None:
        """Look at `node` at `at_s` (default now), after a controller tick of that instant: the
        controller's spare and promotion steps come after its placements."""
        if self.enabled:
            loop = self.cluster.loop
            loop.schedule(loop.now if at_s is None else at_s, self._look, node, priority=LOOK_PRIORITY)

    def _settled(self, node, now: float) -> bool:
        settle_s = self.cluster.spec.settle_s
        for instance in self.cluster.instances.values():
            if instance.node_index != node.index:
                continue
            if instance.phase == InstanceState.LOADING:
                return False
            if instance.ready_s is not None and now - instance.ready_s < settle_s - 1e-9:
                return False
        return True

    def _look(self, node) -> None:
        now = self.cluster.loop.now
        if not self._settled(node, now):
            return  # a later ready or release looks again
        index = node.index
        while self.num_warm[index] + self.num_starting[index] < self.per_node:
            self.num_starting[index] += 1
            self.counts["spares_started"] += 1
            self.cluster.loop.schedule(now + self.cluster.spec.spare_warm_s, self._spare_warm, node, priority=2)
        if self.promote_on_settle:
            self._promote(node, now)

    def _spare_warm(self, node) -> None:
        self.num_starting[node.index] -= 1
        self.num_warm[node.index] += 1

    def _promote(self, node, now: float) -> None:
        cluster = self.cluster
        wanted = set(self._wanted[node.index])
        self._wanted[node.index].clear()
        for instance in cluster.instances.values():
            if instance.node_index == node.index and instance.phase == InstanceState.READY \
                    and instance.tier in _SSD_READ_TIERS:
                wanted.add(instance.model_index)
        promoting = self._promoting[node.index]
        for model_index in sorted(wanted):
            num_bytes = cluster.models[model_index].model.weight_bytes
            if model_index in node.dram or model_index in promoting or not node.dram.fits(num_bytes):
                continue
            promoting.add(model_index)
            cluster.loop.schedule(now + cluster.cost.load_s(num_bytes, "ssd"), self._promoted, node, model_index,
                                  priority=2)

    def _promoted(self, node, model_index: int) -> None:
        self._promoting[node.index].discard(model_index)
        self.counts["dram_promotions"] += 1
        self.cluster.keep_dram_copy(node, model_index)
