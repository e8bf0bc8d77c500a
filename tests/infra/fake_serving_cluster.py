"""A fake `ServingCluster` for `RayGatewayBackend`'s tests, and the helpers they share.

`FakeCluster` plays the controller (a versioned routing table, model records, demand reports that
can start an instance and are answered with a settable `SlotOutlook`, tenants' quotas) and the
instances (scripted streams of `wire.GenerationChunk`s that can be held open, fail, or be
suspended), in plain asyncio, so every decision the backend makes is checked with exact values
and no Ray. `run` runs a test against a started backend on a fresh loop; `until` polls with a
deadline (never a sleep).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from controller import TenantQuota
from controller.slot_outlook import SlotOutlook
from infra.gateway_backend import QueueProgress
from infra.gateway_metrics import GatewayMetrics
from infra.ray_gateway_backend import RayBackendConfig, RayGatewayBackend
from infra.serving_cluster import InstanceGone, InstanceRoute
from wire import GenerationChunk, InstanceLoadRecord, ModelRecord, SamplingParams

MODEL = "acme/tiny"
PARAMS = SamplingParams(max_tokens=3)
FAST = RayBackendConfig(long_poll_s=0.2, retry_interval_s=0.01, demand_report_interval_s=0.05, stale_after_s=0.5,
                        call_timeout_s=0.5)
DEADLINE_S = 5.0


def record(model_id: str, *, max_queued: int = 100, queue_timeout_s: float = 60.0,
           max_model_len: int | None = 256) -> ModelRecord:
    """The controller's record of a model deployed at Unix time 1700000000."""
    return ModelRecord(model_id=model_id, deployed_s=1700000000.0, max_model_len=max_model_len,
                       max_queued_requests=max_queued, queue_timeout_s=queue_timeout_s)


def route(instance_id: str, ongoing: int = 0) -> dict[str, Any]:
    """A routing-table entry as the controller sends it."""
    return InstanceRoute(instance_id, f"worker-{instance_id}", "thaw", "node0", ongoing).to_dict()


class FakeCluster:
    """Controller + instances. `hold` keeps a request's stream open after its first chunk until
    `release(request_id)`; `scale_on_demand` adds an instance the first time demand is reported;
    `outlook` is what every demand report is answered with."""

    def __init__(self) -> None:
        self.version = 1
        self.table: dict[str, list[dict[str, Any]]] = {}
        self.records: dict[str, ModelRecord] = {}
        self.quotas: dict[str, TenantQuota] = {}  # what tenant_quotas answers
        self.num_quota_calls = 0
        self.demand: list[tuple[str, int]] = []
        self.oldest_waits: list[float] = []  # each report's oldest_wait_s, in step with `demand`
        self.outlook: SlotOutlook | None = None
        self.slot_counts: dict[str, int] = {}  # the controller's slot-sharing counters
        self.gauges: list = []  # the controller's engine gauges (wire.EngineGauges)
        self.metrics_snapshots: dict = {}  # gateway replica id -> its last wire.GatewayMetricsSnapshot
        self.served: list[tuple[str, str]] = []  # (request id, instance id)
        self.aborted: list[tuple[str, str]] = []
        self.closed_early: list[str] = []
        self.get_model_calls: list[str] = []
        self.num_table_calls = 0
        self.hold = False
        self.scale_on_demand: str | None = None
        self.fail_before_first: set[str] = set()  # instance ids whose actor is gone
        self.fail_after_first: set[str] = set()
        self.suspend_after_first: set[str] = set()  # instance ids whose slot is preempted mid-stream
        # instance ids that end a stream "abort" on their own after its first token (with one more token)
        self.abort_after_first: set[str] = set()
        self.refuse: Exception | None = None
        self.unreachable = False
        self._releases: dict[str, asyncio.Event] = {}
        self._changed: asyncio.Event | None = None
        self.started: dict[str, asyncio.Event] = {}

    def set_routes(self, model_id: str, routes: list[dict[str, Any]]) -> None:
        self.table[model_id] = routes
        self.bump()

    def bump(self) -> None:
        """A new version: answers the long polls waiting for one."""
        self.version += 1
        if self._changed is not None:
            self._changed.set()
        self._changed = None

    def release(self, request_id: str) -> None:
        self._releases.setdefault(request_id, asyncio.Event()).set()

    def started_event(self, request_id: str) -> asyncio.Event:
        return self.started.setdefault(request_id, asyncio.Event())

    async def routing_table(self, known_version: int, timeout_s: float):
        self.num_table_calls += 1
        if self.unreachable:
            raise ConnectionError("controller down")
        if known_version == self.version and timeout_s > 0:
            if self._changed is None:
                self._changed = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout_s)
        return self.version, {m: list(r) for m, r in self.table.items() if r}

    async def list_models(self):
        if self.unreachable:
            raise ConnectionError("controller down")
        return list(self.records.values())

    async def slot_sharing_counts(self) -> dict[str, int]:
        if self.unreachable:
            raise ConnectionError("controller down")
        return dict(self.slot_counts)

    async def engine_gauges(self) -> list:
        if self.unreachable:
            raise ConnectionError("controller down")
        return list(self.gauges)

    async def exchange_gateway_metrics(self, snapshot) -> list:
        if self.unreachable:
            raise ConnectionError("controller down")
        self.metrics_snapshots[snapshot.replica_id] = snapshot
        return [s for r, s in sorted(self.metrics_snapshots.items()) if r != snapshot.replica_id]

    async def tenant_quotas(self) -> dict[str, TenantQuota]:
        self.num_quota_calls += 1
        if self.unreachable:
            raise ConnectionError("controller down")
        return dict(self.quotas)

    async def get_model(self, model_id: str):
        self.get_model_calls.append(model_id)
        if self.unreachable:
            raise ConnectionError("controller down")
        record = self.records.get(model_id)
        if record is None:
            return None
        instances = tuple(InstanceLoadRecord(instance_id=r["instance_id"], tier="dram", load_s=0.25)
                          for r in self.table.get(model_id, ()))
        return dataclasses.replace(record, instances=instances)

    async def notify_demand(self, model_id: str, num_queued: int, oldest_wait_s: float = 0.0,
                            newest_wait_s: float = 0.0) -> SlotOutlook | None:
        self.demand.append((model_id, num_queued))
        self.oldest_waits.append(oldest_wait_s)
        if num_queued and self.scale_on_demand == model_id:
            self.scale_on_demand = None
            self.set_routes(model_id, [route("cold-1")])
        return self.outlook

    async def generate(self, r: InstanceRoute, request_id: str, prompt: Any, params: SamplingParams, *,
                       sent_token_ids: tuple[int, ...] = ()) -> AsyncIterator[GenerationChunk]:
        if r.instance_id in self.fail_before_first:
            raise InstanceGone(f"instance {r.instance_id} is gone")
        if self.refuse is not None:
            raise self.refuse
        # Token i is 100 + i, so a recovery from the sent tokens continues at their count.
        assert list(sent_token_ids) == [100 + i for i in range(len(sent_token_ids))]
        self.served.append((request_id, r.instance_id) if not sent_token_ids
                           else (request_id, r.instance_id, len(sent_token_ids)))
        finished = False
        try:
            for i in range(len(sent_token_ids), params.max_tokens):
                last = i == params.max_tokens - 1
                yield GenerationChunk(request_id=request_id, text=f"t{i} ", token_ids=(100 + i,),
                                      finish_reason="length" if last else None, num_prompt_tokens=4,
                                      num_completion_tokens=i + 1)
                if i == len(sent_token_ids):
                    self.started_event(request_id).set()
                    if r.instance_id in self.fail_after_first:
                        raise InstanceGone(f"instance {r.instance_id} died")
                    if r.instance_id in self.suspend_after_first:  # as the worker's suspend ends it
                        yield GenerationChunk(request_id=request_id, text="", token_ids=(),
                                              finish_reason="suspended", num_prompt_tokens=4,
                                              num_completion_tokens=i + 1)
                        finished = True
                        return
                    if r.instance_id in self.abort_after_first and not last:
                        yield GenerationChunk(request_id=request_id, text=f"t{i + 1} ", token_ids=(101 + i,),
                                              finish_reason="abort", num_prompt_tokens=4,
                                              num_completion_tokens=i + 2)
                        finished = True
                        return
                    if self.hold:
                        await self._releases.setdefault(request_id, asyncio.Event()).wait()
            finished = True
        finally:
            if not finished:
                self.closed_early.append(request_id)

    async def abort(self, r: InstanceRoute, request_id: str) -> None:
        self.aborted.append((request_id, r.instance_id))
        self.release(request_id)


async def collect(backend: RayGatewayBackend, request_id: str, model_id: str = MODEL, params=PARAMS):
    """The request's chunks, without the progress records a wait in the queue brings."""
    return [item async for item in backend.generate(model_id, request_id, "hello", params)
            if not isinstance(item, QueueProgress)]


async def until(predicate, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def run(test):
    """Runs `test(cluster, backend)` on a fresh loop with a started backend, closing it after."""

    async def main(cluster: FakeCluster, config: RayBackendConfig):
        backend = RayGatewayBackend(cluster, config, GatewayMetrics())
        await backend.start()
        try:
            await asyncio.wait_for(test(cluster, backend), DEADLINE_S * 2)
        finally:
            await backend.close()

    def runner(cluster: FakeCluster | None = None, config: RayBackendConfig = FAST):
        if cluster is None:
            cluster = FakeCluster()
            cluster.records[MODEL] = record(MODEL)
        asyncio.run(main(cluster, config))

    return runner
