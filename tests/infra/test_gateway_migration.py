"""The gateway's side of live migration, on a real platform: a real controller on a local Ray
starting real (migratable) workers, and the real `RayGatewayBackend` over `RayServingCluster`,
read the way the HTTP app reads it.

- a request live-migrated between two instances while the gateway streams it (each method):
  the client's chunks are exactly those of an unmoved run, no token lost or repeated;
- a worker killed mid-stream (a real ``ray.kill``): the gateway resumes the request on the other
  ready instance from the tokens already sent, and the client receives the full greedy output,
  text included, exactly as unbroken;
- the only instance of a model killed mid-stream: the request waits in the model's queue until
  the controller has replaced the instance, then carries on just as well;
- a cold model with no free slot anywhere: the controller empties one instance of a busy model by
  live migration and starts the cold model in its slot; every client gets its full output;
- a node drained (what ``thaw drain`` asks) while requests run on it: they are live-migrated off
  before its workers stop, and every client gets its full output (last: it moves instances).

Every wait is a poll with a deadline; the module ends by checking that no actor is left.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
import ray

from controller import ControllerConfig, start_controller, stop_controller
from infra.controller_client import ControllerClient
from infra.gateway_backend import QueueProgress
from infra.gateway_metrics import GatewayMetrics
from infra.ray_gateway_backend import RayBackendConfig, RayGatewayBackend
from infra.serving_cluster import RayServingCluster
from migration import MigrationMethod, MigrationStatus, RayEndpoint, migrate_request
from storage import RepositoryConfig
from tests.infra.platform_teardown import stop_platform
from worker import DemoModelConfig, SamplingParams, write_demo_model

pytestmark = pytest.mark.slow

TINY_DEMO = DemoModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, max_position_embeddings=256, init_std=0.1, seed=7)
GREEDY = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
PROMPT = "The quick brown fox"
PAIR, SOLO = "acme/pair", "acme/solo"
DEADLINE_S = 120.0
BACKEND = RayBackendConfig(long_poll_s=1.0, stale_after_s=5.0, retry_interval_s=0.1, demand_report_interval_s=0.5)


async def poll(predicate, what: str, timeout_s: float = DEADLINE_S):
    """Awaits until `predicate()` is truthy (returned); a deadline turns a hang into a failure."""
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        await asyncio.sleep(0.05)
    return result


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    """A controller serving two models: PAIR on two instances, SOLO on one (both pinned at that)."""
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    root = tmp_path_factory.mktemp("gateway-migration")
    model_dir = write_demo_model(root / "demo", TINY_DEMO)
    config = ControllerConfig(
        state_dir=root / "state", repository=RepositoryConfig(str(root / "repo")),
        namespace=f"thaw-gm-{uuid.uuid4().hex[:8]}", calibrate=False, cpu_worker_slots_per_node=2, nodes_per_ray_node=3,
        ssd_capacity_bytes=1 << 30, dram_capacity_bytes=256 << 20, reconcile_interval_s=0.2,
        engine_defaults={"block_size": 4, "num_kv_blocks": 256}, report_timeout_s=10.0, drain_timeout_s=60.0)
    controller = start_controller(config, name="thaw-controller-gm")
    ray.get(controller.ping.remote(), timeout=DEADLINE_S)
    for model_id, count in ((PAIR, 2), (SOLO, 1)):
        policy = dict(min_instances=count, max_instances=count, upscale_delay_s=0.0, keep_alive_s=600.0)
        ray.get(controller.deploy.remote({"name": model_id, "source": str(model_dir),
                                          "resources": {"num_cpus": 0.5}, "autoscaling": policy}), timeout=60)
    try:
        yield controller, config.namespace
    finally:
        leftovers = stop_platform(controller, config.namespace)
        if started_here:
            ray.shutdown()
        assert leftovers == [], f"actors left behind: {leftovers}"


class RecordingCluster(RayServingCluster):
    """`RayServingCluster` noting each recovery: (request id, instance id, number of tokens sent)."""

    def __init__(self, controller) -> None:
        super().__init__(ControllerClient(controller))
        self.recoveries: list[tuple[str, str, int]] = []

    def generate(self, route, request_id, prompt, params, *, sent_token_ids=()):
        if sent_token_ids:
            self.recoveries.append((request_id, route.instance_id, len(sent_token_ids)))
        return super().generate(route, request_id, prompt, params, sent_token_ids=sent_token_ids)


def run_with_backend(controller, test):
    """Runs ``test(backend, cluster)`` on a fresh loop with a started gateway backend, once both
    models have all their instances ready in the gateway's table."""

    async def main():
        cluster = RecordingCluster(controller)
        backend = RayGatewayBackend(cluster, BACKEND, GatewayMetrics())
        await backend.start()
        try:
            await poll(lambda: len(backend._routes.get(PAIR, ())) == 2 and len(backend._routes.get(SOLO, ())) == 1,
                       "every instance ready")
            return await asyncio.wait_for(test(backend, cluster), DEADLINE_S * 2)
        finally:
            await backend.close()

    return asyncio.run(main())


async def stream(backend, model_id: str, request_id: str, *, after: int | None = None, action=None) -> list:
    """The request's chunks as the client gets them; ``action(route)`` runs (awaited) once
    ``after`` chunks have arrived, given the route of the instance serving the request then."""
    chunks = []
    async for chunk in backend.generate(model_id, request_id, PROMPT, GREEDY):
        if isinstance(chunk, QueueProgress):  # news while it waits for an instance, not output
            continue
        chunks.append(chunk)
        if after is not None and len(chunks) == after:
            await action(backend._requests[request_id].route)
    return chunks


def whole(chunks) -> tuple[list[int], str, str, int, int]:
    return ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].finish_reason,
            chunks[-1].num_prompt_tokens, chunks[-1].num_completion_tokens)


def actor(route):
    return ray.get_actor(route.actor_name, namespace=route.namespace)


@pytest.mark.parametrize("method", [MigrationMethod.KV, MigrationMethod.TOKENS])
def test_the_gateway_follows_a_request_migrated_mid_stream(platform, method):
    controller, _ = platform

    async def test(backend, cluster):
        expected = await stream(backend, PAIR, f"unmoved-{method.value}")
        outcomes = []

        async def migrate(route):
            [other] = [r for r in backend._routes[PAIR] if r.instance_id != route.instance_id]
            # Frozen first: a tiny model decodes its 150 remaining tokens in well under a second, and
            # a request that finishes before the hand-off has nothing left to follow (the migration
            # module's own tests cover migrating while the source keeps decoding).
            await RayEndpoint(actor(route), route.instance_id).freeze_request(f"moved-{method.value}")
            outcomes.append(await migrate_request(RayEndpoint(actor(route), route.instance_id),
                                                  RayEndpoint(actor(other), other.instance_id),
                                                  f"moved-{method.value}", method))

        moved = await stream(backend, PAIR, f"moved-{method.value}", after=10, action=migrate)
        assert cluster.recoveries == []  # followed, not recovered
        return expected, moved, outcomes

    expected, moved, [outcome] = run_with_backend(controller, test)
    assert outcome.status is MigrationStatus.MIGRATED, outcome.error
    assert whole(moved) == whole(expected) and len(whole(moved)[0]) == GREEDY.max_tokens
    assert [c.num_completion_tokens for c in moved] == list(range(1, GREEDY.max_tokens + 1))
    assert all(c.finish_reason is None for c in moved[:-1]) and moved[-1].finish_reason == "length"


@pytest.mark.parametrize("model_id", [PAIR, SOLO])
def test_a_worker_killed_mid_stream_and_the_client_still_gets_the_full_output(platform, model_id):
    # PAIR: resumed at once on the other ready instance. SOLO: no other instance, so the request
    # waits in the model's queue while the controller replaces the dead one, then resumes there.
    controller, _ = platform
    killed = []

    async def test(backend, cluster):
        expected = await stream(backend, model_id, f"unbroken-{model_id}")

        async def kill(route):
            # Frozen first (no more decoding, nothing sent lost), so that the kill lands mid-stream
            # however fast the tiny model decodes the rest.
            await RayEndpoint(actor(route), route.instance_id).freeze_request(f"broken-{model_id}")
            killed.append(route.instance_id)
            ray.kill(actor(route), no_restart=True)

        broken = await stream(backend, model_id, f"broken-{model_id}", after=15, action=kill)
        # The controller notices the death on its next tick and the gateway's long poll brings the
        # new table; the stream may well have finished first, so poll (with a deadline) for that.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60.0
        instance_ids = {r.instance_id for r in backend._routes.get(model_id, ())}
        while killed and killed[0] in (instance_ids := {r.instance_id for r in backend._routes.get(model_id, ())}):
            assert loop.time() < deadline, "the killed instance never left the gateway's routing table"
            await asyncio.sleep(0.05)  # a poll interval, bounded by the deadline
        return expected, broken, instance_ids, cluster.recoveries

    expected, broken, instance_ids, [recovery] = run_with_backend(controller, test)
    assert recovery[0] == f"broken-{model_id}" and recovery[1] != killed[0]
    assert 15 <= recovery[2] < GREEDY.max_tokens  # resumed from the tokens sent, mid-stream
    assert whole(broken) == whole(expected) and len(whole(broken)[0]) == GREEDY.max_tokens
    assert [c.num_completion_tokens for c in broken] == list(range(1, GREEDY.max_tokens + 1))
    assert all(c.finish_reason is None for c in broken[:-1]) and broken[-1].finish_reason == "length"
    assert killed and killed[0] not in instance_ids  # it really was killed, and dropped from routing


def test_a_cold_model_takes_a_busy_slot_by_migration_and_no_request_is_lost(platform, tmp_path):
    """One node, two slots, both held by HOT's instances with requests running; a request for COLD
    (at zero) makes the controller empty one HOT instance by live migration and start COLD there."""
    hot, cold = "acme/hot", "acme/cold"
    model_dir = write_demo_model(tmp_path / "demo", TINY_DEMO)
    config = ControllerConfig(
        state_dir=tmp_path / "state", repository=RepositoryConfig(str(tmp_path / "repo")),
        namespace=f"thaw-sr-{uuid.uuid4().hex[:8]}", calibrate=False, cpu_worker_slots_per_node=2,
        spare_workers_per_node=0, ssd_capacity_bytes=1 << 30, dram_capacity_bytes=256 << 20,
        reconcile_interval_s=0.2, engine_defaults={"block_size": 4, "num_kv_blocks": 256}, report_timeout_s=10.0,
        drain_timeout_s=60.0)
    controller = start_controller(config, name="thaw-controller-sr")
    ray.get(controller.ping.remote(), timeout=DEADLINE_S)
    for model_id, (low, high) in ((hot, (2, 2)), (cold, (0, 1))):
        policy = dict(min_instances=low, max_instances=high, upscale_delay_s=0.0, keep_alive_s=600.0)
        ray.get(controller.deploy.remote({"name": model_id, "source": str(model_dir),
                                          "resources": {"num_cpus": 0.25}, "autoscaling": policy}), timeout=60)
    num_streams = 4

    async def main():
        cluster = RecordingCluster(controller)
        backend = RayGatewayBackend(cluster, BACKEND, GatewayMetrics())
        await backend.start()
        try:
            await poll(lambda: len(backend._routes.get(hot, ())) == 2, "both hot instances ready")
            expected = await stream(backend, hot, "unmoved")
            started = [asyncio.Event() for _ in range(num_streams)]
            routes = {}

            def freeze(index):
                async def action(route):  # frozen: still running when the reclaim comes, however fast
                    routes[index] = route
                    await RayEndpoint(actor(route), route.instance_id).freeze_request(f"hot-{index}")
                    started[index].set()
                return action

            streams = [asyncio.create_task(stream(backend, hot, f"hot-{i}", after=5, action=freeze(i)))
                       for i in range(num_streams)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), DEADLINE_S)
            cold_stream = asyncio.create_task(stream(backend, cold, "cold-1"))

            def planned():
                decisions = ray.get(controller.status.remote(), timeout=30)["recent_decisions"]
                return next((d for d in decisions if d["kind"] == "slot_reclaim"), None)
            plan = await poll(planned, "the slot reclaim to be planned")
            for i, route in routes.items():  # the requests that stay: let them run again
                if route.instance_id != plan["victim_instance_id"]:
                    await RayEndpoint(actor(route), route.instance_id).unfreeze_request(f"hot-{i}")
            outputs = await asyncio.gather(*streams)
            cold_chunks = await cold_stream
            status = ray.get(controller.status.remote(), timeout=30)
            return expected, outputs, cold_chunks, plan, routes, status, cluster.recoveries
        finally:
            await backend.close()

    try:
        expected, outputs, cold_chunks, plan, routes, status, recoveries = asyncio.run(main())
    finally:
        stop_controller(controller, stop_workers=True)
    assert plan["model_id"] == cold and plan["victim_model_id"] == hot and plan["alternative_s"] is None
    for chunks in outputs:  # every hot request, moved or not, exactly as unmoved
        assert whole(chunks) == whole(expected)
    assert recoveries == []  # moved live, not recovered after a death
    on_victim = [i for i, r in routes.items() if r.instance_id == plan["victim_instance_id"]]
    moved = [d for d in status["recent_decisions"] if d["kind"] == "migration"
             and d["source"] == plan["victim_instance_id"]]
    assert on_victim and sum(d["num_migrated"] for d in moved) == len(on_victim)  # (the gateway spreads them)
    assert cold_chunks[-1].finish_reason == "length" and cold_chunks[-1].num_completion_tokens == GREEDY.max_tokens
    assert [i["model_id"] for i in status["instances"] if i["state"] == "ready"].count(cold) == 1
    assert plan["victim_instance_id"] not in {i["instance_id"] for i in status["instances"]}


def test_draining_a_node_with_running_requests_loses_none(platform):
    controller, _ = platform
    num_streams = 4

    async def test(backend, cluster):
        expected = await stream(backend, PAIR, "undrained")
        started = [asyncio.Event() for _ in range(num_streams)]
        routes = {}

        def note(index):
            async def action(route):
                routes[index] = route
                started[index].set()
            return action

        streams = [asyncio.create_task(stream(backend, PAIR, f"drained-{i}", after=5, action=note(i)))
                   for i in range(num_streams)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), DEADLINE_S)
        node_id = routes[0].node_id
        # The requests on the node are frozen (no more decoding) so that they are still running
        # when the drain comes, however fast the tiny model would finish them: only a migration
        # can complete them now.
        frozen = [f"drained-{i}" for i, r in routes.items() if r.node_id == node_id]
        for i in range(num_streams):
            if routes[i].node_id == node_id:
                await RayEndpoint(actor(routes[i]), routes[i].instance_id).freeze_request(f"drained-{i}")
        result = await controller.drain_node.remote(node_id)
        on_node = {r.instance_id for r in routes.values() if r.node_id == node_id}
        assert on_node <= set(result["stopping"]) and result["migrating"] is True
        outputs = await asyncio.gather(*streams)

        def gone():
            status = ray.get(controller.status.remote(), timeout=30)
            return not any(i["node_id"] == node_id for i in status["instances"]) and status
        status = await poll(gone, "the drained node's instances to stop")
        return expected, outputs, on_node, status, cluster.recoveries, frozen

    expected, outputs, on_node, status, recoveries, frozen = run_with_backend(controller, test)
    assert on_node  # at least the first request ran on the drained node
    for chunks in outputs:
        assert whole(chunks) == whole(expected)
        assert [c.num_completion_tokens for c in chunks] == list(range(1, GREEDY.max_tokens + 1))
    assert recoveries == []  # moved live, not recovered after a death
    moved = [d for d in status["recent_decisions"] if d["kind"] == "migration" and d["source"] in on_node]
    assert sum(d["num_migrated"] for d in moved) == len(frozen) >= 1
