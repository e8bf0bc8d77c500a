"""Keeping node stores' copies in line with the instances that use them: `CheckpointCopies`.

Two reconcile steps of the controller, both about where checkpoints sit on a node:

- pins: a node store keeps pinned exactly the checkpoints its running instances came from (an
  instance whose tier is not known yet -- adopted, or its pin in flight -- keeps every pin of its
  model on its node), so LRU eviction never takes what a worker is reading;
- promotion: a cold start reads from SSD directly (placement chooses DRAM only where a copy is
  there already, and the start pins the tier placement chose, `placement_policy.pin_tier`:
  copying into DRAM first would put a second full read and write on the request's path), so
  once the node has settled, a model its instances loaded from SSD is copied into DRAM where DRAM can take it
  (`dram_can_take`), unpinned, and the next start there is fast. So is a model whose instance
  was evicted for another before it was promoted (`keep_in_dram`): its next cold start on that
  node is a DRAM one. A missed promotion only makes a later start slower; it is logged, never
  an error.

Split out of `controller.Controller`, which owns the state this reads (instances, nodes, models).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping

from controller.control_context import ControlContext
from controller.cluster_client import ClusterClient
from controller.cluster_node import ClusterNode, dram_can_take
from controller.controller_config import ControllerConfig
from controller.controller_status import event_to_dict
from controller.instance_manager import InstanceManager
from controller.managed_instance import ManagedInstance
from controller.model_state import ModelState
from wire import InstanceState

logger = logging.getLogger(__name__)


class CheckpointCopies:
    """Pins and DRAM promotions of the node stores (see the module docstring). Runs on the
    controller's event loop and reads its live `instances`, `nodes` and `models`."""

    def __init__(self, config: ControllerConfig, cluster: ClusterClient, instances: InstanceManager,
                 nodes: Mapping[str, ClusterNode], models: Mapping[str, ModelState], *,
                 context: ControlContext) -> None:
        self.config = config
        self._cluster = cluster
        self._instances = instances
        self._nodes = nodes
        self._models = models
        self._record = context.record
        self._wall_clock = context.wall_clock
        self._background = context.background  # the controller's: it awaits them at shutdown
        self._promoting: set[tuple[str, str]] = set()  # (node id, repository name) being copied into DRAM
        self._wanted: dict[tuple[str, str], str] = {}  # evicted: (node id, repository name) -> model id

    async def reconcile_pins(self) -> list[str]:
        """Unpin what no instance on the node came from; returns one error per failed unpin."""
        calls = []
        for node in self._nodes.values():
            if node.store is None or node.report is None:
                continue
            mine = [i for i in self._instances.all() if i.node_id == node.node_id]
            keep_any = {i.repository_name for i in mine if i.tier is None}
            keep = {(i.repository_name, i.tier) for i in mine if i.tier is not None}
            for tier in node.report.tiers:
                for entry in tier.entries:
                    if entry.pinned and entry.model not in keep_any and (entry.model, tier.tier) not in keep:
                        calls.append(self._cluster.unpin_checkpoint(node.store, entry.model, tier.tier,
                                                                    self.config.report_timeout_s))
        results = await asyncio.gather(*calls, return_exceptions=True)
        return [f"unpin: {result}" for result in results if isinstance(result, BaseException)]

    def keep_in_dram(self, instance: ManagedInstance) -> None:
        """The instance is stopped to give its slot away (evicted): copy its model into its node's
        DRAM tier once the node has settled, if it read it from SSD and DRAM can take it."""
        if instance.tier == "ssd":
            self._wanted[(instance.node_id, instance.repository_name)] = instance.model_id

    def promote_to_dram(self, busy_node_ids: Collection[str]) -> None:
        """Start copying into DRAM, in the background, the models that ready instances loaded
        from SSD (and evicted ones, `keep_in_dram`), on nodes not in `busy_node_ids` (still
        settling after a start)."""
        wanted = [(node_id, name, model_id) for (node_id, name), model_id in self._wanted.items()]
        wanted += [(i.node_id, i.repository_name, i.model_id) for i in self._instances.all()
                   if i.phase is InstanceState.READY and i.tier == "ssd"]
        for node_id, name, model_id in wanted:
            node = self._nodes.get(node_id)
            key = (node_id, name)
            model = self._models.get(model_id)
            if node is None or model is None:
                self._wanted.pop(key, None)
                continue
            if (node.store is None or node_id in busy_node_ids or key in self._promoting
                    or not dram_can_take(node.report, name, model.num_bytes or 0, self.config)):
                if node.report is not None and name in node.report.tier("dram").models:
                    self._wanted.pop(key, None)  # there already
                continue
            self._wanted.pop(key, None)
            self._promoting.add(key)
            task = asyncio.get_running_loop().create_task(self._promote(node, model_id, key))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _promote(self, node: ClusterNode, model_id: str, key: tuple[str, str]) -> None:
        node_id, name = key
        try:
            await self._cluster.prefetch_checkpoint(node.store, name, "dram", self.config.load_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a missed promotion only makes a later start slower
            logger.warning("%s: copying into DRAM on %s failed: %s: %s", model_id, node_id, type(exc).__name__, exc)
        else:
            self._record(event_to_dict("promote", model_id, f"copied into DRAM on {node_id} for fast restarts",
                                       self._wall_clock()))
            logger.info("%s: copied into DRAM on %s", model_id, node_id)
        finally:
            self._promoting.discard(key)
