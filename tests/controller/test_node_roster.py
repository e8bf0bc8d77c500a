"""`NodeRoster` against the fake cluster: nodes join and leave with the Ray nodes, each gets its
store once, a store that died is dropped at the next report and replaced at the next refresh,
and a failure becomes an error line instead of an exception. (The workers' side of the reports is
exercised through the controller in test_controller.py: stats applied, a dead worker replaced.)"""

from __future__ import annotations

import asyncio

from controller import RayNodeInfo
from controller.cluster_node import ClusterNode
from controller.instance_manager import InstanceManager
from controller.node_roster import NodeRoster
from controller.state_location import open_state_store
from controller.control_context import ControlContext
from tests.controller.fake_cluster import FakeCluster
from tests.controller.test_controller import make_config

RAY_A, RAY_B = "a" * 56, "b" * 56


def roster(tmp_path, cluster: FakeCluster) -> tuple[NodeRoster, dict[str, ClusterNode]]:
    config = make_config(tmp_path)
    instances = InstanceManager(config, cluster, open_state_store(tmp_path / "state"), {},
                                on_routes_changed=lambda model_id: None,
                                context=ControlContext(clock=lambda: 0.0, wall_clock=lambda: 0.0,
                                                       record=lambda decision: None, background=set(),
                                                       wake=lambda: None))
    nodes: dict[str, ClusterNode] = {}
    return NodeRoster(config, cluster, nodes, instances, clock=lambda: 0.0), nodes


def test_nodes_follow_the_ray_nodes_and_each_gets_its_store_once(tmp_path):
    async def scenario():
        cluster = FakeCluster((RAY_A,))
        nodes_roster, nodes = roster(tmp_path, cluster)
        assert await nodes_roster.refresh() == []
        [node_a] = nodes.values()
        assert (node_a.ray_node_id, node_a.num_slots, node_a.store) == (RAY_A, 2, cluster.stores[node_a.node_id])
        store_a = node_a.store

        cluster.ray_nodes.append(RayNodeInfo(RAY_B, num_gpus=8))  # a GPU node joins: a slot per GPU
        assert await nodes_roster.refresh() == []
        assert sorted((n.ray_node_id, n.num_slots) for n in nodes.values()) == [(RAY_A, 2), (RAY_B, 8)]
        assert nodes[node_a.node_id].store is store_a  # not started twice

        cluster.ray_nodes[:] = [RayNodeInfo(RAY_B, num_gpus=8)]  # node a left
        assert await nodes_roster.refresh() == []
        assert [n.ray_node_id for n in nodes.values()] == [RAY_B]

    asyncio.run(scenario())


def test_a_store_that_died_is_dropped_at_the_report_and_replaced_at_the_refresh(tmp_path):
    async def scenario():
        cluster = FakeCluster((RAY_A,))
        nodes_roster, nodes = roster(tmp_path, cluster)
        await nodes_roster.refresh()
        [node] = nodes.values()
        assert await nodes_roster.gather_reports() == [] and node.report is not None
        dead = node.store
        dead.alive = False
        assert await nodes_roster.gather_reports() == [f"node {node.node_id}: its store died; starting a new one"]
        assert node.store is None
        assert await nodes_roster.refresh() == []
        assert node.store is not None and node.store is not dead and node.store.alive
        assert await nodes_roster.gather_reports() == [] and node.report_error is None

    asyncio.run(scenario())
