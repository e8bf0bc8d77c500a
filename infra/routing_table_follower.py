"""`RoutingTableFollower`: how the gateway reads the controller's routing table, by long poll.

The gateway's request path must never wait on the controller for a warm model, so
`RayGatewayBackend` serves from its own copy of the routing table (ready instances per model) and
of the deployed models' cards. This class brings the changes to that copy: each `poll` calls
``routing_table`` with the version it holds (the controller answers at once when the table
changes, an instance became ready, and otherwise after the poll's timeout), re-reads the model
records and the tenants' quotas (`quotas`) with each answer, and returns a `RoutingUpdate` when
the table or the records changed -- compared by content, not only by version, since a restarted
controller counts from 0 again. The backend applies the update; the copy is its own.

The same poll brings what the gateway's ``/metrics`` shows of the controller: the slot-sharing
counters, the engine gauges, and the other gateway replicas' per-request series (exchanged at
most once per ``exchange_interval_s``); `record_cold_starts` counts the instances an update
brought as cold starts. A failure there leaves the figures as they were: metrics must not break
routing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from controller import TenantQuota
from infra.gateway_metrics import GatewayMetrics
from infra.gateway_model_info import ModelInfo, model_info_from_record
from infra.serving_cluster import InstanceRoute, ServingCluster
from wire import ModelRecord

__all__ = ["RoutingTableFollower", "RoutingUpdate"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RoutingUpdate:
    """A routing table and model list that differ from the last ones: the ready instances by
    model, the deployed models, and the instances that were not in the previous table, by model."""

    routes: dict[str, list[InstanceRoute]]
    models: dict[str, ModelInfo]
    appeared: dict[str, set[str]]

    def instance_ids(self) -> set[str]:
        """Every instance in the table."""
        return {route.instance_id for entries in self.routes.values() for route in entries}


class RoutingTableFollower:
    """Reads the controller's routing table, model records and quotas (see the module docstring).
    `metrics` None: no figures are read for ``/metrics``."""

    def __init__(self, cluster: ServingCluster, metrics: GatewayMetrics | None, exchange_interval_s: float,
                 clock: Callable[[], float]) -> None:
        self._cluster = cluster
        self._metrics = metrics
        self._exchange_interval_s = exchange_interval_s
        self._clock = clock
        self._version = -1
        self._raw_table: Mapping[str, Any] | None = None
        self._raw_records: list[ModelRecord] | None = None
        self._known_instance_ids: set[str] = set()  # the instances of the last update's table
        self._loaded = False  # an update was returned
        self._quotas: dict[str, TenantQuota] = {}  # tenant -> quota, for the tenants with a limit
        self._last_exchange: float | None = None  # when this replica's metrics last went to its peers

    @property
    def quotas(self) -> Mapping[str, TenantQuota]:
        """The tenants' quotas as of the last poll, for the tenants that have a limit."""
        return self._quotas

    async def poll(self, timeout_s: float) -> RoutingUpdate | None:
        """One routing-table call (waiting up to `timeout_s` for a change), the model records,
        the tenants' quotas and the controller's figures for ``/metrics``; the update when the
        table or the records changed, else None."""
        version, table = await self._cluster.routing_table(self._version, timeout_s)
        records = await self._cluster.list_models()
        self._quotas = dict(await self._cluster.tenant_quotas())
        if self._metrics is not None:
            self._metrics.set_slot_decisions(await self._cluster.slot_sharing_counts())
            self._metrics.set_engine_gauges(await self._cluster.engine_gauges())
            await self._exchange_metrics()
        return self._read(version, table or {}, records)

    def _read(self, version: int, table: Mapping[str, list[Mapping[str, Any]]],
              records: list[ModelRecord]) -> RoutingUpdate | None:
        # Compared by content, not only by version: a restarted controller counts from 0 again.
        if self._loaded and version == self._version and table == self._raw_table \
                and records == self._raw_records:
            return None
        self._raw_table, self._raw_records = table, records
        models = {}
        for record in records:
            try:
                info = model_info_from_record(record)
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("skipping a model record the gateway cannot read: %s", exc)
                continue
            models[info.card.model_id] = info
        routes = {model_id: [InstanceRoute.from_dict(entry) for entry in entries]
                  for model_id, entries in table.items()}
        appeared = {model_id: ids for model_id, entries in routes.items()
                    if (ids := {r.instance_id for r in entries} - self._known_instance_ids)}
        update = RoutingUpdate(routes=routes, models=models, appeared=appeared)
        self._version, self._known_instance_ids, self._loaded = version, update.instance_ids(), True
        return update

    async def _exchange_metrics(self) -> None:
        """Hands this replica's per-request series to its peers through the controller and takes
        theirs (`GatewayMetrics.snapshot`), at most once per ``exchange_interval_s``; a failure
        leaves the peers' last series in place."""
        assert self._metrics is not None
        now = self._clock()
        if self._last_exchange is not None and now - self._last_exchange < self._exchange_interval_s:
            return
        snapshot = self._metrics.snapshot()
        if snapshot is None:
            return
        self._last_exchange = now
        try:
            self._metrics.set_peer_snapshots(await self._cluster.exchange_gateway_metrics(snapshot))
        except Exception as exc:  # noqa: BLE001
            logger.warning("exchanging metrics with the other gateway replicas failed: %s: %s", type(exc).__name__, exc)

    async def record_cold_starts(self, appeared: Mapping[str, set[str]]) -> None:
        """Counts the instances that became ready since the last update as cold starts, by the
        tier their checkpoint was read from (the controller's record says), with their load time.
        Each gateway replica counts the starts it saw: with several replicas, take the max."""
        if self._metrics is None:
            return
        for model_id, instance_ids in appeared.items():
            try:
                record = await self._cluster.get_model(model_id)
            except Exception as exc:  # noqa: BLE001 - metrics must not break routing
                logger.warning("reading %s's instances for the cold-start metrics failed: %s", model_id, exc)
                continue
            for instance in record.instances if record is not None else ():
                if instance.instance_id in instance_ids and instance.load_s is not None:
                    self._metrics.record_cold_start(model_id, instance.tier or "unknown", instance.load_s)
