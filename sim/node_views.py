"""The controller's placement input (`controller.NodeView`) built from the simulated cluster.

The controller gives placement a view of every node; at 1,000 nodes that is a thousand
validated records per decision, and a simulated day holds tens of thousands of decisions. The
nodes are alike (one `TierBandwidths` for all), so a node without the model's checkpoint differs
from another only by its free slots and its loader's wait; the view set is therefore

- every node holding the model in DRAM or SSD (those are the only ones a locality-aware
  placement can prefer for the tier),
- the `num_empty` emptiest nodes with room for it (placement's pick among the rest is one of
  them, up to ties on the node id and loader waits beyond that many nodes; on slot hosts the
  nodes whose roomiest GPU fits it, free loaders first: `SlotHosts.nodes_with_room`),
- and any nodes a caller adds (the nodes of eviction or preemption candidates, whose estimates
  the slot-sharing policies need).

Rates are the cost model's, per tier: `weight_bytes / load_s` for a reference checkpoint, so
placement's estimate and the simulated load agree; the repository is S3.
"""

from __future__ import annotations

from collections.abc import Iterable

from controller import NodeView, TierBandwidths

__all__ = ["NodeViews", "REFERENCE_BYTES", "sim_tier"]

REFERENCE_BYTES = 16 << 30
NUM_EMPTY_NODES = 8


def sim_tier(placement_tier: str) -> str:
    """The cluster's tier name for placement's: its "repository" is S3."""
    return "s3" if placement_tier == "repository" else placement_tier


class NodeViews:
    """Builds `NodeView`s for one model at a time (see the module docstring)."""

    def __init__(self, cluster, *, num_empty: int = NUM_EMPTY_NODES) -> None:
        self.cluster = cluster
        self.num_empty = num_empty
        cost = cluster.cost
        spec = cluster.spec

        def rate(tier: str) -> float:
            return REFERENCE_BYTES / cost.load_s(REFERENCE_BYTES, tier)

        self.bandwidths = TierBandwidths(
            repository_bytes_per_s=rate("s3"),
            ssd_bytes_per_s=rate("ssd") if spec.ssd_bytes_per_node else None,
            dram_bytes_per_s=rate("dram") if spec.dram_bytes_per_node else None)
        self.link_bytes_per_s = rate("remote")
        # Views of nodes whose loader is idle, by (node, free slots, tiers): frozen records, so one
        # serves every placement that would build its equal (a validated NodeView costs ~8 us).
        self._idle_views: dict[tuple, NodeView] = {}

    def view(self, node, model_index: int, now: float, *, locality: bool = True) -> NodeView:
        """The node for one model: its free slots are the cluster's `room` for it (on slot hosts,
        the GPUs that fit its share, so placement's slot count is memory-aware)."""
        tiers = self.cluster.checkpoint_tiers(node, model_index) if locality else ()
        free = self.cluster.room(node, model_index)
        loads = node.loader.loads_left_s(now)
        if loads:  # a short load may pass some of them (`controller.read_path`)
            return NodeView(node_id=node.node_id, num_free_slots=free, bandwidths=self.bandwidths,
                            model_tiers=frozenset(tiers), loader_loads_s=loads,
                            short_fetch_ratio=node.loader.short_fetch_ratio)
        key = (node.index, free, tiers)  # an idle loader: the view is one of few, kept
        view = self._idle_views.get(key)
        if view is None:
            view = self._idle_views[key] = NodeView(node_id=node.node_id, num_free_slots=free,
                                                    bandwidths=self.bandwidths, model_tiers=frozenset(tiers))
        return view

    def candidate_nodes(self, model_index: int, extra: Iterable = (), *, locality: bool = True) -> list:
        state = self.cluster.models[model_index]
        nodes = {n.index: n for n in self.cluster.nodes_with_room(state.num_slots, self.num_empty, model_index)}
        if locality:
            nodes.update((n.index, n) for n in self.cluster.nodes_holding(model_index))
        nodes.update((n.index, n) for n in extra)
        return [nodes[i] for i in sorted(nodes)]

    def views(self, model_index: int, now: float, extra: Iterable = (), *, locality: bool = True) -> list[NodeView]:
        return [self.view(n, model_index, now, locality=locality)
                for n in self.candidate_nodes(model_index, extra, locality=locality)]

    def node_of(self, node_id: str):
        return self.cluster.nodes[int(node_id.rpartition("-")[2])]
