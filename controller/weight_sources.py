"""Where a starting instance's weights come from: `WeightSources`.

Two sources (`controller.stream_source_policy.choose_load_path` picks, at the start): the node's
checkpoint, pinned by the node's store in the tier decided at the start (`pin_checkpoint`: the
SSD instead only when a full DRAM refuses it), or a running instance's stream when it would
deliver the weights sooner (BlitzScale). Instances started together from one peer share one
chain stream (`controller.stream_chains`: each receiver forwards to the next). A streamed
instance still gets its node's copy, pinned while the stream runs and handed to it as the
stream's fallback (`supply_fallback`): what it reads if the peer dies, and what it streams from
once it is a source itself. A peer that cannot stream when the start comes (gone, not ready)
switches the instance to its tier, and the event says why.

Split out of `controller.instance_manager.InstanceManager`, whose start task calls this.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection
from typing import Any

from controller.cluster_client import ClusterClient
from controller.cluster_node import ClusterNode
from controller.controller_config import ControllerConfig
from controller.managed_instance import ManagedInstance
from controller.model_state import ModelState
from controller.stream_chains import StreamChains
from controller.stream_source_policy import LoadPath, choose_load_path
from storage import TierFullError
from wire import InstanceState

__all__ = ["WeightSources"]

logger = logging.getLogger(__name__)


class WeightSources:
    """See the module docstring. `instance(id)`: a live instance by id (the manager's), None if
    gone; `event(kind, instance, reason)`: records a lifecycle event."""

    def __init__(self, config: ControllerConfig, cluster: ClusterClient,
                 instance: Callable[[str], ManagedInstance | None],
                 event: Callable[[str, ManagedInstance, str], None]) -> None:
        self.config = config
        self._cluster = cluster
        self._instance = instance
        self._event = event
        self._chains = StreamChains(self._stream_from)

    def choose_path(self, instance: ManagedInstance, model: ModelState, tier: str, estimate_s: float,
                    live: list[ManagedInstance], draining_node_ids: Collection[str]) -> None:
        """With `config.peer_stream`, sets `instance.load_path`: a running instance's stream when
        it is estimated faster than `tier` in `estimate_s` (and joins that peer's chain)."""
        settings = self.config.peer_stream
        if settings is None:
            return
        instance.load_path = choose_load_path(
            model.model_id, instance.node_id, model.num_bytes, tier, estimate_s, live, draining_node_ids,
            link_bytes_per_s=settings.link_bytes_per_s, saturated_requests=settings.saturated_requests)
        if instance.load_path.kind == "stream":  # a tier load is the placement decision's own story
            self._chains.join(instance.load_path.source_instance_id, instance.instance_id)

    async def open_stream(self, instance: ManagedInstance) -> Any | None:
        """The ticket of a stream from the peer `instance.load_path` chose; None (and the load path
        switched to the tier, saying why) when there is none or the peer cannot stream now."""
        path, settings = instance.load_path, self.config.peer_stream
        if path is None or path.kind != "stream" or settings is None:
            return None
        source = self._instance(path.source_instance_id)
        try:
            if instance.phase is not InstanceState.LOADING:
                self._chains.leave(instance.instance_id)
                return None
            if source is None or source.phase is not InstanceState.READY or source.handle is None:
                self._chains.leave(instance.instance_id)
                raise RuntimeError("it is no longer ready")
            ticket, rank, length = await self._chains.ticket(instance.instance_id, source.handle)
            if length > 1:
                instance.load_path = dataclasses.replace(path, reason=f"{path.reason}; receiver {rank} of a chain "
                                                                      f"of {length} (each forwards to the next)")
            logger.info("%s: %s takes its weights by %s", instance.model_id, instance.instance_id,
                        instance.load_path.reason)
            self._event("load_path", instance, instance.load_path.reason)
            return ticket
        except Exception as exc:  # noqa: BLE001 - the tier is the fallback whatever the peer said
            reason = f"{path.tier}: streaming from {path.source_instance_id} refused ({exc})"
            instance.load_path = LoadPath("tier", path.tier, instance.estimate_s or 0.0, None, reason)
            logger.info("%s: instance %s loads from its node: %s", instance.model_id, instance.instance_id, reason)
            self._event("load_path", instance, reason)
            return None

    async def _stream_from(self, source_handle: Any, num_receivers: int) -> Any:
        settings = self.config.peer_stream
        assert settings is not None  # no instance joins a chain without it
        return await self._cluster.stream_weights(source_handle, num_receivers, settings.stream_config(),
                                                  self.config.report_timeout_s)

    async def supply_fallback(self, instance: ManagedInstance, model: ModelState, node: ClusterNode,
                               checkpoint_tier: str) -> None:
        """Brings the checkpoint to the streamed instance's node while the stream runs (pinned like
        any instance's, in the tier decided at its start) and hands the worker its path: what it
        reads if the peer dies, and what it streams from once it is a source itself."""
        try:
            path, instance.tier = await self.pin_checkpoint(node, model.repository_name, checkpoint_tier)
            if instance.phase is InstanceState.STOPPING or instance.handle is None:
                return
            await self._cluster.supply_fallback(instance.handle, path, self.config.report_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the stream may still complete; the log says what is missing
            logger.warning("%s: instance %s has no node copy to fall back on: %s", instance.model_id,
                           instance.instance_id, exc)
            self._event("fallback_unavailable", instance, f"{type(exc).__name__}: {exc}")

    async def pin_checkpoint(self, node: ClusterNode, name: str, tier: str) -> tuple[str, str]:
        """(local path, tier) of the model on the node, pinned in `tier` (decided at the start);
        SSD instead only when the store refuses DRAM as full."""
        if node.store is None:
            raise RuntimeError(f"node {node.node_id} has no connected store")
        try:
            return await self._cluster.pin_checkpoint(node.store, name, tier, self.config.load_timeout_s), tier
        except TierFullError as exc:
            if tier != "dram":
                raise
            logger.info("node %s: DRAM cannot take %s (%s); reading it from SSD", node.node_id, name, exc)
            return await self._cluster.pin_checkpoint(node.store, name, "ssd", self.config.load_timeout_s), "ssd"
