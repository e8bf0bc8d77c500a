"""What a request waiting at the gateway hears (`RayGatewayBackend` against the fake cluster):
progress records with the controller's outlook, the reasons and Retry-After of a 429 or 503, the
oldest wait each demand report carries, and the controller's slot decisions on /metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from controller.slot_outlook import SlotHolder, SlotOutlook
from infra.gateway_backend import ModelOverloaded, QueueProgress, QueueTimeout
from infra.gateway_metrics import GatewayMetrics
from infra.openai_errors import error_from_backend
from infra.ray_gateway_backend import RayGatewayBackend
from tests.infra.fake_serving_cluster import FAST, MODEL, PARAMS, FakeCluster, collect, record, route, run, until


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


def test_every_ready_instances_engine_gauges_are_exported_on_metrics_under_both_names():
    from wire import EngineGauges

    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    cluster.gauges = [EngineGauges("i-a", MODEL, "node-a", 3, 1, 0.25), EngineGauges("i-b", MODEL, "node-b", 0, 0, 0.0)]

    async def test(cluster, backend):
        ours = f'{{instance="i-a",model="{MODEL}",node="node-a"}}'
        await until(lambda: metric(backend, "thaw_engine_requests_running" + ours) == "3.0", "the first refresh")
        assert metric(backend, "thaw_engine_requests_waiting" + ours) == "1.0"
        assert metric(backend, "thaw_engine_kv_cache_usage" + ours) == "0.25"
        theirs = f'{{engine="i-a",model_name="{MODEL}"}}'
        assert [metric(backend, name + theirs) for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                            "vllm:kv_cache_usage_perc")] == ["3.0", "1.0", "0.25"]
        assert metric(backend, f'thaw_engine_requests_running{{instance="i-b",model="{MODEL}",node="node-b"}}') == "0.0"
        cluster.gauges = cluster.gauges[:1]  # i-b stopped: its series end
        cluster.bump()
        await until(lambda: metric(backend, f'thaw_engine_requests_running{{instance="i-b",model="{MODEL}",'
                                            f'node="node-b"}}') is None, "the next refresh")

    run(test)(cluster)


def test_replicas_exchange_their_request_series_and_any_replica_renders_all_of_them_labelled():
    from infra.gateway_metrics import ReplicaIdentity

    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL)
    peer = GatewayMetrics(replica=ReplicaIdentity("r-peer", "node-b"))
    peer.record_request(MODEL, "chat", 200)
    peer.record_first_token(MODEL, 0.2)
    cluster.metrics_snapshots["r-peer"] = peer.snapshot()
    cluster.slot_counts = {"evictions": 2}

    async def main():
        metrics = GatewayMetrics(replica=ReplicaIdentity("r-own", "node-a"))
        backend = RayGatewayBackend(cluster, FAST, metrics)
        await backend.start()
        try:
            metrics.record_request(MODEL, "chat", 200)
            metrics.record_request(MODEL, "chat", 200)
            await until(lambda: "r-own" in cluster.metrics_snapshots, "this replica's series sent")
            lines = metrics.render()[0].decode().splitlines()
            own = f'thaw_gateway_requests_total{{endpoint="chat",model="{MODEL}",node="node-a",replica="r-own",status="200"}}'
            theirs = f'thaw_gateway_requests_total{{endpoint="chat",model="{MODEL}",node="node-b",replica="r-peer",status="200"}}'
            assert f"{own} 2.0" in lines and f"{theirs} 1.0" in lines
            assert f'vllm:time_to_first_token_seconds_count{{model_name="{MODEL}",node="node-b",replica="r-peer"}} 1.0' \
                in lines
            assert sum(line.startswith("# TYPE thaw_gateway_requests_total ") for line in lines) == 1  # one family
            await until(lambda: 'thaw_slot_decisions{kind="evictions"} 2.0' in metrics.render()[0].decode(),
                        "the platform's series")
            platform = [line for line in metrics.render()[0].decode().splitlines() if "slot_decisions{" in line]
            assert platform == ['thaw_slot_decisions{kind="evictions"} 2.0']  # once, unlabelled
        finally:
            await backend.close()

    asyncio.run(main())


def test_a_peer_snapshot_that_does_not_parse_is_left_out_of_the_scrape():
    from infra.gateway_metrics import ReplicaIdentity
    from wire import GatewayMetricsSnapshot

    metrics = GatewayMetrics(replica=ReplicaIdentity("r-own", "node-a"))
    metrics.record_request(MODEL, "chat", 200)
    metrics.set_peer_snapshots([GatewayMetricsSnapshot("r-bad", "node-b", "not { a metric line\n"),
                                GatewayMetricsSnapshot("r-own", "node-a", "ignored: this replica's own\n")])
    text = metrics.render()[0].decode()
    assert 'replica="r-own"' in text and "r-bad" not in text and "ignored" not in text
