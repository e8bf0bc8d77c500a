"""`RayGatewayBackend`'s routing, queueing, retries and aborts, against a fake `ServingCluster`
(tests/infra/fake_serving_cluster.py): every decision the backend makes is checked with exact
values, with no Ray. The same backend over real Ray is exercised by test_platform_e2e.py and
test_chaos.py; what a waiting request hears is in test_gateway_queue_news.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

import pytest

from controller import TenantQuota
from infra.gateway_backend import (BackendUnavailable, ContextLengthExceeded, GatewayBackend, InvalidRequest,
                                   ModelNotFound, ModelOverloaded, QueueProgress, QueueTimeout)
from infra.gateway_metrics import GatewayMetrics
from infra.openai_errors import error_from_backend
from infra.ray_gateway_backend import RayBackendConfig, RayGatewayBackend
from worker import InvalidFieldError
from tests.infra.fake_serving_cluster import (DEADLINE_S, FAST, MODEL, PARAMS, FakeCluster, collect, record, route, run,
                                             until)


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
        assert [c.num_completion_tokens for c in chunks] == [1, 2, 3]
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
        assert len(chunks) == 1 and chunks[0].finish_reason == "abort" and chunks[0].num_completion_tokens == 0
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
        assert [c.num_completion_tokens for c in chunks] == list(range(1, PARAMS.max_tokens + 1))
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


def test_an_abort_the_gateway_did_not_ask_for_is_continued_elsewhere_not_cut_short():
    cluster = FakeCluster()
    cluster.records[MODEL] = record(MODEL, queue_timeout_s=30.0)
    cluster.set_routes(MODEL, [route("stopping"), route("next", ongoing=9)])
    cluster.abort_after_first = {"stopping"}

    async def test(cluster, backend):
        chunks = await collect(backend, "cut")
        # Its two tokens from "stopping" reach the client; "next" continues from them.
        assert cluster.served == [("cut", "stopping"), ("cut", "next", 2)]
        assert [c.token_ids for c in chunks] == [(100 + i,) for i in range(PARAMS.max_tokens)]
        assert [c.finish_reason for c in chunks] == [None] * (PARAMS.max_tokens - 1) + ["length"]
        assert cluster.aborted == [] and backend.inflight() == {}

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
