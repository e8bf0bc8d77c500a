"""`RayGatewayBackend`'s routing, queueing, retries and aborts, against a fake `ServingCluster`.

The fake plays the controller (a versioned routing table, model records, demand reports that
can start an instance and are answered with a settable `SlotOutlook`) and the instances
(scripted streams of `worker.GenerationChunk`s that can be held open), in plain asyncio: every
decision the backend makes is checked with exact values, with no Ray. The same backend over
real Ray is exercised by test_platform_e2e.py. Waiting is always on an event or a poll with a
deadline, never on a sleep; the tests of waiting requests also cover what they hear (progress
records, the reasons and Retry-After of 429/503) and the oldest wait each report carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from controller import TenantQuota
from controller.slot_outlook import SlotHolder, SlotOutlook
from infra.gateway_backend import (
    BackendUnavailable,
    ContextLengthExceeded,
    GatewayBackend,
    InvalidRequest,
    ModelNotFound,
    ModelOverloaded,
    QueueProgress,
    QueueTimeout,
)
from infra.gateway_metrics import GatewayMetrics
from infra.openai_errors import error_from_backend
from infra.ray_gateway_backend import RayBackendConfig, RayGatewayBackend
from infra.serving_cluster import InstanceGone, InstanceRoute
from worker import GenerationChunk, InvalidFieldError, SamplingParams

MODEL = "acme/tiny"
PARAMS = SamplingParams(max_tokens=3)
FAST = RayBackendConfig(long_poll_s=0.2, retry_interval_s=0.01, demand_report_interval_s=0.05, stale_after_s=0.5,
                        call_timeout_s=0.5)
DEADLINE_S = 5.0


def record(model_id: str, *, max_queued: int = 100, queue_timeout_s: float = 60.0,
           max_model_len: int | None = 256) -> dict[str, Any]:
    tenant, name = model_id.split("/")
    return {"model_id": model_id, "created_s": 1700000000,
            "spec": {"tenant": tenant, "name": name, "source": "/models/x", "max_model_len": max_model_len,
                     "autoscaling": {"max_queued_requests": max_queued, "queue_timeout_s": queue_timeout_s}}}


def route(instance_id: str, ongoing: int = 0) -> dict[str, Any]:
    return {"instance_id": instance_id, "actor_name": f"worker-{instance_id}", "namespace": "thaw",
            "node_id": "node0", "num_ongoing_requests": ongoing}


class FakeCluster:
    """Controller + instances. `hold` keeps a request's stream open after its first chunk until
    `release(request_id)`; `scale_on_demand` adds an instance the first time demand is reported;
    `outlook` is what every demand report is answered with."""

    def __init__(self) -> None:
        self.version = 1
        self.table: dict[str, list[dict[str, Any]]] = {}
        self.records: dict[str, dict[str, Any]] = {}
        self.quotas: dict[str, TenantQuota] = {}  # what tenant_quotas answers
        self.num_quota_calls = 0
        self.demand: list[tuple[str, int]] = []
        self.oldest_waits: list[float] = []  # each report's oldest_wait_s, in step with `demand`
        self.outlook: SlotOutlook | None = None
        self.slot_counts: dict[str, int] = {}  # the controller's slot-sharing counters
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
        instances = [{"instance_id": r["instance_id"], "tier": "dram", "load_s": 0.25}
                     for r in self.table.get(model_id, ())]
        return {**record, "instances": instances}

    async def notify_demand(self, model_id: str, num_queued: int, oldest_wait_s: float = 0.0) -> SlotOutlook | None:
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


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="long_poll_s"):
        RayBackendConfig(long_poll_s=0)
    with pytest.raises(ValueError, match="must be longer than long_poll_s"):
        RayBackendConfig(long_poll_s=10, stale_after_s=5)
    with pytest.raises(ValueError, match="max_ongoing_requests_per_instance"):
        RayBackendConfig(max_ongoing_requests_per_instance=0)
    with pytest.raises(ValueError, match="progress_interval_s"):
        RayBackendConfig(progress_interval_s=0)
    with pytest.raises(ValueError, match="max_retry_after_s"):
        RayBackendConfig(max_retry_after_s=float("inf"))


def test_meets_the_gateway_protocol():
    assert isinstance(RayGatewayBackend(FakeCluster()), GatewayBackend)


def test_warm_model_goes_to_the_least_loaded_instance_without_asking_the_controller():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    cluster.set_routes(MODEL, [route("a", ongoing=5), route("b", ongoing=1), route("c", ongoing=1)])

    async def test(cluster, backend):
        calls_before = cluster.num_table_calls
        cluster.hold = True
        first = asyncio.ensure_future(collect(backend, "r1"))
        await cluster.started_event("r1").wait()
        second = asyncio.ensure_future(collect(backend, "r2"))
        await cluster.started_event("r2").wait()
        third = asyncio.ensure_future(collect(backend, "r3"))
        await cluster.started_event("r3").wait()
        # Equal local load: the controller's report breaks the tie, then the instance id.
        assert cluster.served == [("r1", "b"), ("r2", "c"), ("r3", "a")]
        for request_id in ("r1", "r2", "r3"):
            cluster.release(request_id)
        chunks = await first
        await second, await third
        assert [c.text for c in chunks] == ["t0 ", "t1 ", "t2 "]
        assert [c.num_output_tokens for c in chunks] == [1, 2, 3]
        assert chunks[-1].finished and chunks[-1].finish_reason == "length" and not chunks[0].finished
        assert chunks[0].queue_s is not None and chunks[0].queue_s < 0.5 and chunks[1].queue_s is None
        assert cluster.get_model_calls == [] and cluster.demand == []
        assert cluster.num_table_calls - calls_before <= 2  # only the background long poll, no call per request
        assert backend.inflight() == {}

    run(test)(cluster)


def test_cold_model_waits_reports_demand_and_then_succeeds():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    cluster.scale_on_demand = MODEL

    async def test(cluster, backend):
        chunks = await collect(backend, "cold")
        assert cluster.served == [("cold", "cold-1")]
        cold_start = f'thaw_cold_starts_total{{model="{MODEL}",tier="dram"}} 1.0'
        await until(lambda: cold_start in backend._metrics.render()[0].decode(), "the cold start counted")
        assert f'thaw_load_seconds_sum{{model="{MODEL}",tier="dram"}} 0.25' in backend._metrics.render()[0].decode()
        assert chunks[0].queue_s > 0 and chunks[-1].finish_reason == "length"
        assert cluster.demand[0] == (MODEL, 1)
        await until(lambda: cluster.demand[-1] == (MODEL, 0), "the drained queue reported as 0")
        assert [d for d in cluster.demand if d[1] == 0] == [(MODEL, 0)]

    run(test)(cluster)


def test_a_full_queue_is_429_and_the_deadline_503_with_retry_after():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL, max_queued=2, queue_timeout_s=0.3)

    async def test(cluster, backend):
        waiting = [asyncio.ensure_future(collect(backend, f"q{i}")) for i in range(2)]
        await until(lambda: cluster.demand and cluster.demand[-1] == (MODEL, 2), "two queued requests reported")
        with pytest.raises(ModelOverloaded) as overloaded:
            await collect(backend, "q2")
        assert overloaded.value.retry_after_s == FAST.retry_after_s and "max_queued_requests" in str(overloaded.value)
        for future in waiting:
            with pytest.raises(QueueTimeout) as timeout:
                await future
            assert timeout.value.retry_after_s == FAST.retry_after_s and "0.3 s" in str(timeout.value)
        await until(lambda: cluster.demand[-1] == (MODEL, 0), "the emptied queue reported")
        assert cluster.served == []

    run(test)(cluster)


def test_a_tenant_at_its_queued_quota_gets_429_naming_it_and_another_tenant_is_unaffected():
    """acme may have 2 requests waiting over all its models (each model alone allows 100);
    other has no quota. The quota comes with the backend's refresh, never on the request path."""
    cluster = FakeCluster()
    a1, a2, o1 = "acme/a1", "acme/a2", "other/o1"
    for model_id in (a1, a2, o1):
        cluster.records[model_id] = record(model_id)
    cluster.quotas["acme"] = TenantQuota(max_queued_requests=2)

    async def test(cluster, backend):
        waiting = [asyncio.ensure_future(collect(backend, "r1", a1)), asyncio.ensure_future(collect(backend, "r2", a2))]
        await until(lambda: {(a1, 1), (a2, 1)} <= set(cluster.demand), "acme's two queued requests reported")
        with pytest.raises(ModelOverloaded) as overloaded:
            await collect(backend, "r3", a1)
        assert str(overloaded.value) == ("tenant 'acme' has 2 requests waiting for instances, its quota "
                                         "(max_queued_requests 2); retry later")
        error = error_from_backend(overloaded.value)
        assert (error.status_code, error.headers) == (429, {"Retry-After": "1"})
        assert error.body()["error"]["message"] == str(overloaded.value)

        # Another tenant queues past acme's number: its requests wait and are served.
        waiting += [asyncio.ensure_future(collect(backend, f"o{i}", o1)) for i in range(3)]
        await until(lambda: (o1, 3) in cluster.demand, "other's three queued requests reported")
        assert cluster.get_model_calls == []  # models and quotas came from the refresh, not the request path
        for model_id in (a1, a2, o1):
            cluster.set_routes(model_id, [route(f"{model_id.split('/')[1]}-1")])
        results = await asyncio.gather(*waiting)
        assert [chunks[-1].finish_reason for chunks in results] == ["length"] * 5
        assert sorted(cluster.served) == [("o0", "o1-1"), ("o1", "o1-1"), ("o2", "o1-1"), ("r1", "a1-1"),
                                          ("r2", "a2-1")]

        # A lowered quota arrives with the next refresh (the table changed: at once).
        calls = cluster.num_quota_calls
        cluster.quotas["acme"] = TenantQuota(max_queued_requests=1)
        cluster.table[a1], cluster.table[a2] = [], []  # scaled to zero: acme's requests queue again
        cluster.bump()
        await until(lambda: cluster.num_quota_calls > calls, "a refresh that read the quotas")
        num_reports = len(cluster.demand)
        queued = asyncio.ensure_future(collect(backend, "q1", a2))
        await until(lambda: (a2, 1) in cluster.demand[num_reports:], "acme's queued request reported")
        with pytest.raises(ModelOverloaded) as overloaded:
            await collect(backend, "q2", a1)
        assert str(overloaded.value) == ("tenant 'acme' has 1 requests waiting for instances, its quota "
                                         "(max_queued_requests 1); retry later")
        assert [c.finish_reason for c in await collect(backend, "o3", o1)] == [None, None, "length"]
        await backend.abort(a2, "q1")
        assert [c.finish_reason for c in await queued] == ["abort"]

    run(test)(cluster)


def test_a_saturated_model_queues_in_order_and_a_finished_request_frees_the_slot():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    cluster.set_routes(MODEL, [route("only")])
    config = RayBackendConfig(long_poll_s=0.2, demand_report_interval_s=0.05, max_ongoing_requests_per_instance=1)

    async def test(cluster, backend):
        cluster.hold = True
        first = asyncio.ensure_future(collect(backend, "first"))
        await cluster.started_event("first").wait()
        later = [asyncio.ensure_future(collect(backend, name)) for name in ("second", "third")]
        await until(lambda: cluster.demand and cluster.demand[-1] == (MODEL, 2), "the saturated queue reported")
        cluster.release("first")
        await first
        await cluster.started_event("second").wait()
        assert [s[0] for s in cluster.served] == ["first", "second"]  # FIFO, and one at a time
        cluster.release("second")
        await cluster.started_event("third").wait()
        cluster.release("third")
        await asyncio.gather(*later)
        assert [s[0] for s in cluster.served] == ["first", "second", "third"]

    run(test)(cluster, config)


def test_abort_while_queued_ends_with_abort_and_while_running_reaches_the_instance():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    cluster.records["acme/cold"] = record("acme/cold")
    cluster.set_routes(MODEL, [route("a")])

    async def test(cluster, backend):
        queued = asyncio.ensure_future(collect(backend, "queued", "acme/cold"))
        await until(lambda: cluster.demand and cluster.demand[-1] == ("acme/cold", 1), "queued")
        await backend.abort("acme/cold", "queued")
        chunks = await queued
        assert len(chunks) == 1 and chunks[0].finish_reason == "abort" and chunks[0].num_output_tokens == 0
        cluster.hold = True
        running = asyncio.ensure_future(collect(backend, "running"))
        await cluster.started_event("running").wait()
        await backend.abort("acme/other", "running")  # another model's id: ignored
        await backend.abort(MODEL, "unknown")
        assert cluster.aborted == []
        await backend.abort(MODEL, "running")
        assert cluster.aborted == [("running", "a")]
        await running
        await until(lambda: cluster.demand[-1] == ("acme/cold", 0), "the aborted wait taken back")

    run(test)(cluster)


def test_a_client_leaving_closes_the_instance_stream_and_frees_the_slot():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    cluster.set_routes(MODEL, [route("a")])

    async def test(cluster, backend):
        cluster.hold = True
        stream = backend.generate(MODEL, "left", "hello", PARAMS)
        first = await stream.__anext__()
        assert first.text == "t0 " and backend.inflight() == {"a": 1}
        await stream.aclose()
        assert cluster.closed_early == ["left"] and backend.inflight() == {}
        # A cancelled waiter (the client left while queued) gives its place back too.
        cluster.set_routes(MODEL, [])
        await until(lambda: backend._routes.get(MODEL) is None, "the instance gone from the cache")
        task = asyncio.ensure_future(collect(backend, "gone"))
        await until(lambda: cluster.demand and cluster.demand[-1] == (MODEL, 1), "queued")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: cluster.demand[-1] == (MODEL, 0), "the cancelled wait taken back")
        assert backend._requests == {}

    run(test)(cluster)


def test_a_gone_instance_is_skipped_and_a_request_it_dropped_midway_resumes_elsewhere_from_the_sent_tokens():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL, queue_timeout_s=0.3)
    cluster.set_routes(MODEL, [route("dead"), route("live", ongoing=3)])
    cluster.fail_before_first = {"dead"}

    async def test(cluster, backend):
        chunks = await collect(backend, "retry")
        assert cluster.served == [("retry", "live")] and chunks[-1].finish_reason == "length"
        assert chunks[0].queue_s is not None
        await collect(backend, "again")  # "dead" is now skipped up front
        assert cluster.served[-1] == ("again", "live")

        # "live" dies after its first token; "spare" (added now) continues from that token on.
        cluster.fail_after_first = {"live"}
        cluster.set_routes(MODEL, [route("dead"), route("live"), route("spare", ongoing=9)])
        await until(lambda: len(backend._routes.get(MODEL, ())) == 3, "the gateway to see the new instance")
        chunks = await collect(backend, "midway")
        assert cluster.served[-2:] == [("midway", "live"), ("midway", "spare", 1)]
        assert [c.token_ids for c in chunks] == [(100 + i,) for i in range(PARAMS.max_tokens)]
        assert "".join(c.text for c in chunks) == "".join(f"t{i} " for i in range(PARAMS.max_tokens))
        assert [c.num_output_tokens for c in chunks] == list(range(1, PARAMS.max_tokens + 1))
        assert chunks[0].queue_s is not None and all(c.queue_s is None for c in chunks[1:])
        assert chunks[-1].finish_reason == "length" and backend.inflight() == {}

        # With no instance left to take it, the failure is reported in-band, after what was sent.
        cluster.fail_after_first = {"spare"}
        cluster.set_routes(MODEL, [route("spare")])
        await until(lambda: [r.instance_id for r in backend._routes.get(MODEL, ())] == ["spare"], "the new table")
        stream = backend.generate(MODEL, "stranded", "hello", PARAMS)
        assert (await stream.__anext__()).text == "t0 "
        with pytest.raises(QueueTimeout):  # waited in the model's queue for an instance that never came
            await stream.__anext__()
        assert backend.inflight() == {}

    run(test)(cluster, dataclasses.replace(FAST, max_attempts=2))


def test_a_suspended_request_waits_for_the_models_next_instance_and_continues_from_the_sent_tokens():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL, queue_timeout_s=30.0)
    cluster.set_routes(MODEL, [route("first")])
    cluster.suspend_after_first = {"first", "second"}

    async def test(cluster, backend):
        items = []

        async def client():
            async for item in backend.generate(MODEL, "paused", "hello", PARAMS):
                items.append(item)

        task = asyncio.create_task(client())
        await until(lambda: cluster.served == [("paused", "first")], "the first instance to serve it")
        # Suspended after its first token: the slot went to another model; none of this model is routed.
        cluster.set_routes(MODEL, [])
        await until(lambda: any(isinstance(i, QueueProgress) for i in items), "a progress record while it waits")
        assert cluster.demand[-1] == (MODEL, 1)  # back in the queue, reported as demand
        cluster.set_routes(MODEL, [route("second")])  # the model's next instance, preempted in turn
        await until(lambda: cluster.served[-1] == ("paused", "second", 1), "the second instance to continue it")
        cluster.set_routes(MODEL, [route("third")])
        await asyncio.wait_for(task, DEADLINE_S)
        chunks = [i for i in items if not isinstance(i, QueueProgress)]
        assert cluster.served == [("paused", "first"), ("paused", "second", 1), ("paused", "third", 2)]
        # Exactly the uninterrupted output: no token lost or repeated, no "suspended" reaching the client.
        assert [c.token_ids for c in chunks] == [(100 + i,) for i in range(PARAMS.max_tokens)]
        assert [c.finish_reason for c in chunks] == [None] * (PARAMS.max_tokens - 1) + ["length"]
        assert backend.inflight() == {}

    # one attempt allowed: two suspensions are no failures
    run(test)(cluster, dataclasses.replace(FAST, max_attempts=1))


def test_worker_refusals_name_the_field_and_a_long_prompt_is_context_length_exceeded():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    cluster.set_routes(MODEL, [route("a")])

    async def test(cluster, backend):
        cluster.refuse = InvalidFieldError("prompt is 300 tokens but the model's context is 256 tokens "
                                           "(including at least one output token); shorten the prompt", "prompt")
        with pytest.raises(ContextLengthExceeded) as too_long:
            await collect(backend, "long")
        assert too_long.value.param == "prompt" and too_long.value.code == "context_length_exceeded"
        cluster.refuse = InvalidFieldError("request needs up to 999 KV-cache slots", "max_tokens")
        with pytest.raises(InvalidRequest) as bad:
            await collect(backend, "big")
        assert bad.value.param == "max_tokens" and not isinstance(bad.value, ContextLengthExceeded)
        assert backend.inflight() == {}

    run(test)(cluster)


def test_models_come_from_the_cache_and_unknown_ones_from_the_controller():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    cluster.records["other/m"] = record("other/m", max_model_len=None)

    async def test(cluster, backend):
        assert [c.model_id for c in await backend.list_models(None)] == [MODEL, "other/m"]
        assert [c.model_id for c in await backend.list_models("acme")] == [MODEL]
        card = await backend.describe_model(MODEL)
        assert (card.owned_by, card.created_s, card.max_model_len) == ("acme", 1700000000, 256)
        assert cluster.get_model_calls == []
        with pytest.raises(ModelNotFound):
            await backend.describe_model("acme/missing")
        cluster.records["acme/new"] = record("acme/new")  # deployed since the last refresh
        assert (await backend.describe_model("acme/new")).model_id == "acme/new"
        assert cluster.get_model_calls == ["acme/missing", "acme/new"]

    run(test)(cluster)


def test_a_model_deleted_while_requests_wait_fails_them_as_not_found():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)

    async def test(cluster, backend):
        waiting = asyncio.ensure_future(collect(backend, "w"))
        await until(lambda: cluster.demand and cluster.demand[-1] == (MODEL, 1), "queued")
        del cluster.records[MODEL]
        cluster.bump()
        with pytest.raises(ModelNotFound):
            await waiting

    run(test)(cluster)


def test_readiness_follows_the_controller():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    cluster.set_routes(MODEL, [route("a")])

    async def test(cluster, backend):
        assert await backend.is_ready()
        cluster.unreachable = True
        await until(lambda: not backend._last_refresh_ok or
                    asyncio.get_running_loop().time() - backend._last_refresh_ok > FAST.stale_after_s,
                    "the cache to go stale")
        assert not await backend.is_ready()
        # A warm model keeps serving from the cache while the controller is away.
        assert (await collect(backend, "warm"))[-1].finish_reason == "length"
        with pytest.raises(BackendUnavailable, match="unreachable"):
            await backend.describe_model("acme/uncached")
        cluster.unreachable = False
        assert await backend.is_ready()

    run(test)(cluster)


def test_instance_gauge_follows_the_table():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    cluster.set_routes(MODEL, [route("a"), route("b")])

    async def main():
        metrics = GatewayMetrics()
        backend = RayGatewayBackend(cluster, FAST, metrics)
        await backend.start()
        try:
            body = metrics.render()[0].decode()
            assert f'thaw_model_instances{{model="{MODEL}"}} 2.0' in body
            cluster.set_routes(MODEL, [])
            await until(lambda: f'thaw_model_instances{{model="{MODEL}"}} 0.0' in metrics.render()[0].decode(),
                        "the gauge at 0")
        finally:
            await backend.close()
        with contextlib.suppress(BackendUnavailable):
            await backend.list_models(None)

    asyncio.run(main())


# ---- what a waiting request hears: progress, reasons, and the oldest wait reported ------------

PROGRESS = dataclasses.replace(FAST, progress_interval_s=0.01)
WAITING = SlotOutlook(model_id=MODEL, status="waiting_for_slot", position=2, estimate_s=1.4)
HELD = SlotOutlook(model_id=MODEL, status="waiting_for_slot", position=1, estimate_s=4.2, holders=(
    SlotHolder(node_id="node0", instance_id="i-1", model_id="demo/tiny", state="ready", num_ongoing_requests=2),))


class ManualClock:
    """The backend's clock, moved by hand (asyncio's own timers still run on the loop's clock)."""

    def __init__(self, now_s: float) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def metric(backend: RayGatewayBackend, sample: str) -> str | None:
    """The value of one exposition line starting with `sample`, or None if absent."""
    for line in backend._metrics.render()[0].decode().splitlines():
        if line.startswith(sample + " "):
            return line.split()[-1]
    return None


def test_a_queued_stream_hears_the_controllers_outlook_until_its_chunks_come():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)

    async def test(cluster, backend):
        stream = backend.generate(MODEL, "waits", "hello", PARAMS)
        # No outlook yet (the controller answered None): the generic line.
        assert await stream.__anext__() == QueueProgress(text="waiting for an instance")
        cluster.outlook = WAITING  # the next report (every 0.05 s while the queue waits) brings it
        items = [await stream.__anext__()]
        while items[-1] != QueueProgress(text="waiting for a slot: position 2, about 1.4 s"):
            assert items[-1] == QueueProgress(text="waiting for an instance")
            items.append(await stream.__anext__())
        cluster.set_routes(MODEL, [route("a")])  # the instance is ready: the request leaves the queue
        rest = [item async for item in stream]
        progress = [item for item in rest if isinstance(item, QueueProgress)]
        assert rest[:len(progress)] == progress  # every progress record before the first chunk
        assert set(progress) <= {QueueProgress(text="waiting for a slot: position 2, about 1.4 s")}
        chunks = rest[len(progress):]
        assert [c.text for c in chunks] == ["t0 ", "t1 ", "t2 "] and chunks[-1].finish_reason == "length"
        assert chunks[0].queue_s > 0 and cluster.served == [("waits", "a")]
        sample = f'thaw_queue_wait_seconds_count{{cause="waiting_for_slot",model="{MODEL}",outcome="served"}}'
        assert metric(backend, sample) == "1.0"
        await until(lambda: cluster.demand[-1] == (MODEL, 0), "the drained queue reported")
        assert backend._outlooks.model_ids() == []  # dropped with the queue

    run(test)(cluster, PROGRESS)


def test_progress_does_not_move_the_queue_deadline():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL, queue_timeout_s=0.3)
    cluster.outlook = WAITING

    async def test(cluster, backend):
        items = []
        with pytest.raises(QueueTimeout):  # were the deadline restarted by each record, this would not end
            async for item in backend.generate(MODEL, "never", "hello", PARAMS):
                items.append(item)
        assert len(items) > 1 and all(isinstance(item, QueueProgress) for item in items)
        sample = f'thaw_queue_wait_seconds_count{{cause="waiting_for_slot",model="{MODEL}",outcome="timed_out"}}'
        assert metric(backend, sample) == "1.0"
        await until(lambda: cluster.demand[-1] == (MODEL, 0), "the expired wait taken back")

    run(test)(cluster, PROGRESS)


def test_a_client_leaving_at_a_progress_record_gives_back_its_place_and_any_instance_handed_to_it():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)

    async def test(cluster, backend):
        # Left (abort, then close, as the gateway's stream does) while nothing was free.
        stream = backend.generate(MODEL, "left", "hello", PARAMS)
        assert isinstance(await stream.__anext__(), QueueProgress)
        await backend.abort(MODEL, "left")
        await stream.aclose()
        assert backend._requests == {} and not any(backend._queues.values())
        await until(lambda: cluster.demand[-1] == (MODEL, 0), "the left wait taken back")

        # Closed just after an instance was handed to it, before it could take it: given back.
        stream = backend.generate(MODEL, "late", "hello", PARAMS)
        assert isinstance(await stream.__anext__(), QueueProgress)
        cluster.set_routes(MODEL, [route("a")])
        await until(lambda: backend.inflight() == {"a": 1}, "the instance handed to the waiting request")
        await stream.aclose()
        assert backend.inflight() == {} and backend._requests == {} and cluster.served == []
        sample = f'thaw_queue_wait_seconds_count{{cause="unknown",model="{MODEL}",outcome="aborted"}}'
        assert metric(backend, sample) == "2.0"

    run(test)(cluster, PROGRESS)


def test_429_and_503_say_why_and_retry_after_follows_the_estimate():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL, max_queued=1, queue_timeout_s=0.3)
    long_model = "acme/long"  # its request waits as long as the checks take
    cluster.records[long_model] = record(long_model, max_queued=1)
    cluster.outlook = HELD
    why = ("waiting for a slot: position 1, about 4.2 s; slots held by another tenant's model (serving 2); "
           "estimated 4.2 s until an instance is ready")

    async def test(cluster, backend):
        waiting = asyncio.ensure_future(collect(backend, "q0"))
        await until(lambda: backend._outlooks.get(MODEL) == HELD, "the outlook answering the report")
        with pytest.raises(ModelOverloaded) as overloaded:
            await collect(backend, "q1")
        assert str(overloaded.value) == (f"model {MODEL!r} has 1 requests waiting for an instance, its limit "
                                         f"(max_queued_requests): {why}; retry later")
        assert overloaded.value.retry_after_s == 5
        with pytest.raises(QueueTimeout) as timeout:
            await waiting
        assert str(timeout.value) == (f"no instance of model {MODEL!r} became ready within its queue timeout "
                                      f"of 0.3 s: {why}; retry later")
        error = error_from_backend(timeout.value)
        assert (error.status_code, error.headers) == (503, {"Retry-After": "5"})
        assert error.body()["error"]["message"] == str(timeout.value)

        # An estimate past the cap is capped; none at all falls back to the configured hint.
        cluster.outlook = dataclasses.replace(HELD, model_id=long_model, estimate_s=500.0)
        waiting = asyncio.ensure_future(collect(backend, "q2", long_model))
        await until(lambda: backend._outlooks.get(long_model) == cluster.outlook, "the long estimate")
        with pytest.raises(ModelOverloaded) as overloaded:
            await collect(backend, "q3", long_model)
        assert overloaded.value.retry_after_s == PROGRESS.max_retry_after_s == 60
        assert error_from_backend(overloaded.value).headers == {"Retry-After": "60"}
        cluster.outlook = dataclasses.replace(HELD, model_id=long_model, estimate_s=None)
        await until(lambda: backend._outlooks.get(long_model) == cluster.outlook, "no estimate")
        with pytest.raises(ModelOverloaded) as overloaded:
            await collect(backend, "q4", long_model)
        assert overloaded.value.retry_after_s == PROGRESS.retry_after_s
        await backend.abort(long_model, "q2")
        assert [c.finish_reason for c in await waiting] == ["abort"]

    run(test)(cluster, PROGRESS)


def test_demand_reports_carry_the_oldest_wait_on_the_backends_clock():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    clock = ManualClock(1000.0)

    async def main():
        backend = RayGatewayBackend(cluster, FAST, GatewayMetrics(), clock=clock)
        await backend.start()
        try:
            first = asyncio.ensure_future(collect(backend, "first"))
            await until(lambda: cluster.demand == [(MODEL, 1)], "the first report")
            assert cluster.oldest_waits == [0.0]
            clock.now_s = 1002.5  # the unchanged queue is re-reported every interval, with its age
            await until(lambda: cluster.oldest_waits[-1] == 2.5, "the wait re-reported")
            assert cluster.demand[-1] == (MODEL, 1)
            second = asyncio.ensure_future(collect(backend, "second"))
            await until(lambda: cluster.demand[-1] == (MODEL, 2), "the second request reported")
            assert cluster.oldest_waits[-1] == 2.5  # still the first one's wait
            await backend.abort(MODEL, "first")
            await until(lambda: cluster.demand[-1] == (MODEL, 1), "the first request gone")
            assert cluster.oldest_waits[-1] == 0.0  # the second joined at 1002.5
            await backend.abort(MODEL, "second")
            assert [c.finish_reason for c in await first + await second] == ["abort", "abort"]
            await until(lambda: cluster.demand[-1] == (MODEL, 0), "the emptied queue")
            assert cluster.oldest_waits[-1] == 0.0
        finally:
            await backend.close()

    asyncio.run(main())


def test_the_controllers_slot_decisions_are_exported_on_metrics():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    cluster.slot_counts = {"evictions": 3, "preemptions_suspended": 1}

    async def test(cluster, backend):
        await until(lambda: metric(backend, 'thaw_slot_decisions{kind="evictions"}') == "3.0", "the first refresh")
        assert metric(backend, 'thaw_slot_decisions{kind="preemptions_suspended"}') == "1.0"
        cluster.slot_counts = {"evictions": 4, "preemptions_suspended": 1}
        cluster.bump()  # the long poll answers: the next refresh reads the counters again
        await until(lambda: metric(backend, 'thaw_slot_decisions{kind="evictions"}') == "4.0", "the next refresh")

    run(test)(cluster)


def test_a_503_says_what_failed_but_carries_no_internal_exception_text():
    """Issue 19: the body of a 503 after the instances failed a request named the engine's own
    RuntimeError; the cause goes to the log, the client learns what happened."""
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    cluster.set_routes(MODEL, [route("broken")])
    cluster.fail_before_first = {"broken"}

    async def test(cluster, backend):
        with pytest.raises(BackendUnavailable) as info:
            await collect(backend, "doomed")
        message = str(info.value)
        assert message == f"model {MODEL!r}: the instance serving this request failed (1 tried); retry later"
        assert "is gone" not in message  # the fake instance's own exception text
        error = error_from_backend(info.value)
        assert error.status_code == 503 and "is gone" not in json.dumps(error.body())

    run(test)(cluster, dataclasses.replace(FAST, max_attempts=1))


def test_an_unknown_model_costs_one_controller_lookup_per_ttl_and_a_deploy_clears_its_miss():
    """Issue 19: every request for an unknown name asked the controller. A miss is remembered
    for ``unknown_model_ttl_s`` on the backend's clock, and forgotten once a refresh lists it."""
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    now = [100.0]
    missing = "acme/missing"

    async def listed() -> list[str]:
        return [card.model_id for card in await backend.list_models(None)]

    async def until_listed(expected: list[str]) -> None:
        deadline = asyncio.get_running_loop().time() + DEADLINE_S
        while await listed() != expected:
            assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for the listing {expected}"
            await asyncio.sleep(0.001)

    async def main() -> None:
        await backend.start()
        try:
            for _ in range(3):
                with pytest.raises(ModelNotFound):
                    await backend.describe_model(missing)
            assert cluster.get_model_calls == [missing]  # the 2nd and 3rd came from the cache
            now[0] += 2.9
            with pytest.raises(ModelNotFound):
                await backend.describe_model(missing)
            assert cluster.get_model_calls == [missing]
            now[0] += 0.2  # past the 3 s TTL: ask again
            with pytest.raises(ModelNotFound):
                await backend.describe_model(missing)
            assert cluster.get_model_calls == [missing, missing]
            # Deployed, seen by a refresh (the miss is dropped), deleted, seen again: then deployed
            # once more, not yet refreshed. Within the TTL, the lookup must still reach the
            # controller; a miss kept from before the first deploy would answer 404.
            cluster.records[missing] = record(missing)
            cluster.bump()
            await until_listed([missing, MODEL])
            del cluster.records[missing]
            cluster.bump()
            await until_listed([MODEL])
            cluster.records[missing] = record(missing)
            assert (await backend.describe_model(missing)).model_id == missing
            assert cluster.get_model_calls == [missing, missing, missing]
        finally:
            await backend.close()

    backend = RayGatewayBackend(cluster, FAST, GatewayMetrics(), clock=lambda: now[0])
    asyncio.run(asyncio.wait_for(main(), DEADLINE_S * 2))


def test_unknown_model_ttl_zero_asks_the_controller_every_time():
    cluster = FakeCluster()

    async def test(cluster, backend):
        for _ in range(2):
            with pytest.raises(ModelNotFound):
                await backend.describe_model("acme/missing")
        assert cluster.get_model_calls == ["acme/missing", "acme/missing"]

    run(test)(cluster, dataclasses.replace(FAST, unknown_model_ttl_s=0.0))
    with pytest.raises(ValueError, match="unknown_model_ttl_s must be a finite number >= 0"):
        RayBackendConfig(unknown_model_ttl_s=-1)
