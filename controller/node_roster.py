"""The controller's nodes and what they report: `NodeRoster`, the first two steps of a tick.

1. `refresh`: the live Ray nodes give the logical nodes (`plan_nodes`: several per Ray node on a
   dev machine, one per Ray node in a cluster); a node that joined gets its node store (found by
   name, else started), one that left is forgotten;
2. `gather_reports`: every node store's holdings and rates and every ready worker's stats,
   gathered in parallel with a timeout each. A worker's live report always wins over what the
   controller believed (`InstanceManager.apply_stats`); a dead one is dropped and replaced.

Neither step raises for a node or worker that did not answer: each returns its errors, one line
each, for the tick's record, and the controller goes on with what it has. The node map is the
controller's (shared with its other parts); this class only keeps it current.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from controller.cluster_client import ActorGoneError, ClusterClient
from controller.cluster_node import ClusterNode, node_kind_text, plan_nodes
from controller.controller_config import ControllerConfig
from controller.instance_manager import InstanceManager
from wire import InstanceState

logger = logging.getLogger(__name__)

__all__ = ["NodeRoster"]


class NodeRoster:
    """See the module docstring. Runs on the controller's event loop."""

    def __init__(self, config: ControllerConfig, cluster: ClusterClient, nodes: dict[str, ClusterNode],
                 instances: InstanceManager, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._cluster = cluster
        self._nodes = nodes
        self._instances = instances
        self._clock = clock

    async def refresh(self) -> list[str]:
        """Nodes joined and left (the live Ray nodes, planned into logical nodes), and a store for
        every node without one; returns the errors, one line each."""
        planned = plan_nodes(await self._cluster.list_nodes(), self.config.nodes_per_ray_node,
                             self.config.cpu_worker_slots_per_node, self.config.excluded_ray_node_ids,
                             slots_per_gpu=self.config.slots_per_gpu)
        for plan in planned:
            node = self._nodes.get(plan.node_id)
            if node is None:
                self._nodes[plan.node_id] = ClusterNode(plan.node_id, plan.ray_node_id, plan.num_slots, plan.num_gpus,
                                                        plan.accelerator)
                logger.info("node %s (Ray node %s, %s, %d worker slots) joined", plan.node_id, plan.ray_node_id,
                            node_kind_text(plan.num_gpus, plan.accelerator), plan.num_slots)
            else:
                node.num_slots, node.num_gpus, node.accelerator = plan.num_slots, plan.num_gpus, plan.accelerator
        for node_id in set(self._nodes) - {plan.node_id for plan in planned}:
            logger.warning("node %s left the cluster", node_id)
            del self._nodes[node_id]
        unconnected = [node for node in self._nodes.values() if node.store is None]
        config = self.config
        results = await asyncio.gather(*(
            self._cluster.connect_node_store(node.node_id, node.ray_node_id, config.node_store_config(node.node_id))
            for node in unconnected), return_exceptions=True)
        errors = []
        for node, result in zip(unconnected, results):
            if isinstance(result, BaseException):
                node.report_error = f"cannot start its store: {result}"
                errors.append(f"node {node.node_id}: {node.report_error}")
            else:
                node.store = result
        return errors

    async def gather_reports(self) -> list[str]:
        """Every store's report and every ready worker's stats, in parallel, each with its timeout;
        a store that died is dropped (the next `refresh` starts another), a worker whose actor
        is gone is `InstanceManager.died`. Returns the errors, one line each."""
        timeout_s = self.config.report_timeout_s
        nodes = [node for node in self._nodes.values() if node.store is not None]
        reporting = (InstanceState.READY, InstanceState.ASLEEP)  # a sleeper's death frees its memory
        ready = [i for i in self._instances.all() if i.phase in reporting and i.handle is not None]
        results = await asyncio.gather(
            *(self._cluster.node_store_report(node.store, timeout_s) for node in nodes),
            *(self._cluster.worker_stats(instance.handle, timeout_s) for instance in ready),
            return_exceptions=True)
        errors = []
        for node, result in zip(nodes, results[:len(nodes)]):
            if isinstance(result, ActorGoneError):
                node.store, node.report_error = None, "its store died; starting a new one"
            elif isinstance(result, BaseException):
                node.report_error = f"no report: {type(result).__name__}: {result}"
            else:
                node.report, node.report_error = result, None
            if node.report_error:
                errors.append(f"node {node.node_id}: {node.report_error}")
        now = self._clock()
        for instance, result in zip(ready, results[len(nodes):]):
            if instance.phase not in reporting or self._instances.get(instance.instance_id) is not instance:
                continue  # stopped while we waited
            if isinstance(result, ActorGoneError):
                self._instances.died(instance, str(result))
            elif isinstance(result, BaseException):
                errors.append(f"instance {instance.instance_id}: no stats: {type(result).__name__}: {result}")
            else:
                self._instances.apply_stats(instance, result, now)
        return errors
