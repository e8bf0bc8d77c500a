"""`RayGatewayBackend`'s routing, queueing, retries and aborts, against a fake `ServingCluster`.

The fake plays the controller (a versioned routing table, model records, demand reports that
can start an instance) and the instances (scripted streams of `worker.GenerationChunk`s that can
be held open), in plain asyncio: every decision the backend makes is checked with exact values,
with no Ray. The same backend over real Ray is exercised by test_platform_e2e.py. Waiting is
always on an event or a poll with a deadline, never on a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest

from infra.gateway_backend import (
    BackendUnavailable,
    ContextLengthExceeded,
    GatewayBackend,
    InvalidRequest,
    ModelNotFound,
    ModelOverloaded,
    QueueTimeout,
)
from infra.gateway_metrics import GatewayMetrics
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
    `release(request_id)`; `scale_on_demand` adds an instance the first time demand is reported."""

    def __init__(self) -> None:
        self.version = 1
        self.table: dict[str, list[dict[str, Any]]] = {}
        self.records: dict[str, dict[str, Any]] = {}
        self.demand: list[tuple[str, int]] = []
        self.served: list[tuple[str, str]] = []  # (request id, instance id)
        self.aborted: list[tuple[str, str]] = []
        self.closed_early: list[str] = []
        self.get_model_calls: list[str] = []
        self.num_table_calls = 0
        self.hold = False
        self.scale_on_demand: str | None = None
        self.fail_before_first: set[str] = set()  # instance ids whose actor is gone
        self.fail_after_first: set[str] = set()
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

    async def notify_demand(self, model_id: str, num_queued: int) -> None:
        self.demand.append((model_id, num_queued))
        if num_queued and self.scale_on_demand == model_id:
            self.scale_on_demand = None
            self.set_routes(model_id, [route("cold-1")])

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
    return [chunk async for chunk in backend.generate(model_id, request_id, "hello", params)]


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
        assert backend._inflight == {}

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
        assert first.text == "t0 " and backend._inflight == {"a": 1}
        await stream.aclose()
        assert cluster.closed_early == ["left"] and backend._inflight == {}
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
        assert chunks[-1].finish_reason == "length" and backend._inflight == {}

        # With no instance left to take it, the failure is reported in-band, after what was sent.
        cluster.fail_after_first = {"spare"}
        cluster.set_routes(MODEL, [route("spare")])
        await until(lambda: [r.instance_id for r in backend._routes.get(MODEL, ())] == ["spare"], "the new table")
        stream = backend.generate(MODEL, "stranded", "hello", PARAMS)
        assert (await stream.__anext__()).text == "t0 "
        with pytest.raises(QueueTimeout):  # waited in the model's queue for an instance that never came
            await stream.__anext__()
        assert backend._inflight == {}

    run(test)(cluster, dataclasses.replace(FAST, max_attempts=2))


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
        assert backend._inflight == {}

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
