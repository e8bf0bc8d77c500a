"""Handing prompts that wait on a streamed instance to fully loaded ones: `PrefillHelper`.

Each tick, after the stats are in, `hand_over_waiting` plans with the pure
`plan_prefill_handoffs` (which prompt, which helper) and starts each hand-over in the background
(`migration.hand_over_prefill` through the cluster, method ``"layer"``): the tick never waits for
a helper's compute, and a prompt is never handed over twice at once. The client's stream follows
the request to the helper as after any live migration; a hand-over that fails leaves the prompt
on its instance, whole, to finish when the layers land. Each attempt is a decision
(``prefill_handoff``) in ``thaw status`` and the log.

Split out of `controller.Controller`; on only while `ControllerConfig.peer_stream` says so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

from controller.control_context import ControlContext
from controller.cluster_client import ClusterClient
from controller.controller_config import ControllerConfig
from controller.instance_manager import InstanceManager
from controller.prefill_handoff_policy import PrefillHandoff, plan_prefill_handoffs

logger = logging.getLogger(__name__)


class PrefillHelper:
    def __init__(self, config: ControllerConfig, cluster: ClusterClient, instances: InstanceManager, *,
                 draining_nodes: Callable[[], Collection[str]], context: ControlContext) -> None:
        self.config = config
        self._cluster = cluster
        self._instances = instances
        self._draining_nodes = draining_nodes
        self._record = context.record
        self._wall_clock = context.wall_clock
        self._background = context.background
        self._in_flight: set[str] = set()  # request ids being handed over

    async def hand_over_waiting(self) -> list[str]:
        """Starts the hand-overs the policy plans now; returns no errors (each one is recorded)."""
        settings = self.config.peer_stream
        if settings is None or not settings.hand_over_prefills:
            return []
        plan = plan_prefill_handoffs(self._instances.all(), saturated_requests=settings.saturated_requests,
                                     draining_node_ids=self._draining_nodes(), in_flight=self._in_flight)
        for handoff in plan:
            self._in_flight.add(handoff.request_id)
            task = asyncio.get_running_loop().create_task(self._hand_over(handoff))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return []

    async def _hand_over(self, handoff: PrefillHandoff) -> None:
        source = self._instances.get(handoff.source_id)
        helper = self._instances.get(handoff.helper_id)
        try:
            if source is None or helper is None:
                return  # stopped since the plan
            try:
                outcomes = await self._cluster.migrate_requests(
                    source.handle, source.instance_id, helper.handle, helper.instance_id, [handoff.request_id],
                    "layer", self.config.migration_timeout_s)
                status, error = outcomes[0].status, outcomes[0].error
                status = getattr(status, "value", status)
            except Exception as exc:  # noqa: BLE001 - a hung or dead instance: the prompt stays where it was
                status, error = "failed", f"{type(exc).__name__}: {exc}"
            # The source's last report still lists the prompt; it is not there to move any more.
            source.prefills_at_frontier = tuple(r for r in source.prefills_at_frontier if r != handoff.request_id)
            self._record({"kind": "prefill_handoff", "at_s": self._wall_clock(), "model_id": source.model_id,
                          "request_id": handoff.request_id, "source": source.instance_id,
                          "helper": helper.instance_id, "status": status, "error": error})
            log = logger.info if status == "migrated" else logger.warning
            log("%s: prompt %s waiting on instance %s (weights still arriving) -> instance %s: %s%s",
                source.model_id, handoff.request_id, source.instance_id, helper.instance_id, status,
                f" ({error})" if error else "")
        finally:
            self._in_flight.discard(handoff.request_id)
