"""Sleep before stop (issue 38, Build 4, CPU form): where a node shares a worker memory budget, a
model scaling down puts its idle instance to sleep (KV pool freed, weights kept in its process)
and its next demand wakes it without a load; sleepers are evicted first."""

from __future__ import annotations

import asyncio

from tests.controller.fake_cluster import FakeCluster
from tests.controller.test_controller import MODEL_BYTES, RAY_NODE, Harness, eventually, settle, spec
from tests.controller.test_slot_sharer import deploy, kinds

MIB = 1 << 20
KV = 512 * MIB  # the harness's default KV pool


async def asleep_model(h: Harness, name: str, seed: int) -> tuple[str, str]:
    """Deploys `name` with a 5 s keep-alive, serves it once, lets its keep-alive pass: asleep."""
    model_id = await deploy(h, name, seed, keep_alive_s=5.0)
    h.controller.notify_demand(model_id, 1)
    await h.tick()
    [instance] = h.controller.get_model(model_id)["instances"]
    h.controller.notify_demand(model_id, 0)
    await h.tick(1.0)
    await h.tick(6.0)  # past its keep-alive: scaled to zero
    await eventually(lambda: instance["instance_id"] in h.cluster.slept_workers, f"{name}'s instance asleep")
    return model_id, instance["instance_id"]


def test_a_model_past_its_keep_alive_sleeps_and_its_next_demand_wakes_the_same_worker(tmp_path):
    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=4, worker_memory_bytes=1100 * MIB) as h:
            a, instance_id = await asleep_model(h, "a", 1)
            assert h.routes(a) == [] and h.cluster.stopped_workers == [] and h.cluster.released_workers == []
            [instance] = h.controller.get_model(a)["instances"]
            assert (instance["state"], instance["held_memory_bytes"]) == ("asleep", MODEL_BYTES)
            assert h.records()[instance_id] == "asleep"
            [node] = h.controller.status()["nodes"]
            assert node["worker_memory"]["used_bytes"] == MODEL_BYTES  # its KV pool's share is free
            assert node["num_free_slots"] == 4  # a sleeper holds no slot
            [sleep] = kinds(h, "sleep")
            assert sleep["reason"] == "scaling down to 0; asleep rather than stopped, its weights kept"
            assert h.controller.get_model(a)["num_desired_instances"] == 0

            started = h.cluster.num_started_workers
            h.controller.notify_demand(a, 1)
            await h.tick()
            await eventually(lambda: h.routes(a) == [instance_id], "a routed again")
            assert h.cluster.woken_workers == [instance_id] and h.cluster.num_started_workers == started
            [woke] = kinds(h, "woke")
            assert woke["instance_id"] == instance_id and "(no load)" in woke["reason"]
            assert len(kinds(h, "ready")) == 1  # its first start only
            [node] = h.controller.status()["nodes"]
            assert node["worker_memory"]["used_bytes"] == MODEL_BYTES + KV
            counts = h.controller.slot_sharing_counts()
            assert (counts["sleeps"], counts["wakes"]) == (1, 1)

    asyncio.run(scenario())


def test_without_a_memory_budget_or_with_sleep_off_a_model_past_its_keep_alive_stops(tmp_path):
    async def scenario(**config):
        async with Harness(tmp_path / str(len(config)), cpu_worker_slots_per_node=4, **config) as h:
            a = await deploy(h, "a", 1, keep_alive_s=5.0)
            h.controller.notify_demand(a, 1)
            await h.tick()
            [instance] = h.controller.get_model(a)["instances"]
            h.controller.notify_demand(a, 0)
            await h.tick(1.0)
            await h.tick(6.0)
            await eventually(lambda: h.controller.get_model(a)["instances"] == [], "a's instance gone")
            assert h.cluster.slept_workers == [] and kinds(h, "sleep") == []
            return instance["instance_id"]

    asyncio.run(scenario())
    asyncio.run(scenario(worker_memory_bytes=1100 * MIB, sleep_idle_instances=False))


def test_a_worker_that_cannot_sleep_is_stopped_as_before(tmp_path):
    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=4, worker_memory_bytes=1100 * MIB) as h:
            a = await deploy(h, "a", 1, keep_alive_s=5.0)
            h.controller.notify_demand(a, 1)
            await h.tick()
            [worker] = h.cluster.live_workers()
            h.cluster.refuse_sleep.add(worker.instance_id)  # a request raced the decision
            h.controller.notify_demand(a, 0)
            await h.tick(1.0)
            await h.tick(6.0)
            await eventually(lambda: h.controller.get_model(a)["instances"] == [], "a's instance gone")
            [failed] = kinds(h, "sleep_failed")
            assert failed["reason"].startswith("could not sleep (RuntimeError: instance ")
            assert failed["reason"].endswith("; stopping it instead")
            assert h.cluster.slept_workers == []

    asyncio.run(scenario())


def test_a_sleeper_is_evicted_before_an_idle_awake_instance_when_memory_is_short(tmp_path):
    """Budget 1,100 MiB: a asleep holds its 1 MB, b awake and idle 1 MB + 512 MiB. c's pool is
    sized so that c fits once a's weights are gone, not before: a goes, b stays."""
    async def scenario():
        budget = 1100 * MIB
        async with Harness(tmp_path, cpu_worker_slots_per_node=4, worker_memory_bytes=budget) as h:
            a, a_instance = await asleep_model(h, "a", 1)
            b = await deploy(h, "b", 2, keep_alive_s=60.0)
            h.controller.notify_demand(b, 1)
            await h.tick()
            h.controller.notify_demand(b, 0)
            c = "acme/c"
            h.cluster.model_bytes["acme--c"] = MODEL_BYTES
            kv = budget - MODEL_BYTES - (MODEL_BYTES + KV)  # all b leaves, a's weights included
            await h.controller.deploy({**spec(c, h.source("c", 3), keep_alive_s=60.0), "kv_cache_bytes": kv})
            h.controller.notify_demand(c, 1, "gw", 0.0)
            await h.tick(1.0)
            [eviction] = kinds(h, "eviction")
            assert (eviction["instance_id"], eviction["more_victims"]) == (a_instance, [])
            assert eviction["reason"].startswith(f"evict asleep {a_instance} ({a}, ")
            await eventually(lambda: h.controller.get_model(a)["instances"] == [], "a's sleeper gone")
            await h.tick()  # the held room is free: c starts there
            assert h.routes(c) != [] and h.routes(b) != []
            assert h.cluster.released_workers == [a_instance]  # its process is a spare again

    asyncio.run(scenario())


def test_a_sleeper_whose_node_has_no_room_for_its_kv_pool_is_stopped_and_the_model_placed_afresh(tmp_path):
    async def scenario():
        budget = 1100 * MIB
        async with Harness(tmp_path, cpu_worker_slots_per_node=4, worker_memory_bytes=budget) as h:
            a, a_instance = await asleep_model(h, "a", 1)
            b = "acme/b"
            h.cluster.model_bytes["acme--b"] = MODEL_BYTES
            kv = budget - 2 * MODEL_BYTES - KV + MIB  # b leaves a's weights room, not its KV pool
            await h.controller.deploy({**spec(b, h.source("b", 2), keep_alive_s=60.0), "kv_cache_bytes": kv})
            h.controller.notify_demand(b, 1)
            await h.tick()
            assert h.routes(b) != []
            h.controller.notify_demand(a, 1)
            await h.tick()
            stops = [d for d in kinds(h, "stop") if d["instance_id"] == a_instance]
            assert [d["reason"] for d in stops] == [
                "wanted again, but its node has no slot or no memory for its KV pool now"]
            assert h.cluster.woken_workers == []

    asyncio.run(scenario())


def test_two_sleepers_on_one_node_wake_only_as_far_as_its_memory_goes(tmp_path):
    """a's two instances sleep; b then takes enough of the budget that one KV pool fits back, not
    two: one sleeper wakes, the other is stopped (the second is checked against what the first
    took, not the view before it)."""
    async def scenario():
        budget = 1100 * MIB
        async with Harness(tmp_path, cpu_worker_slots_per_node=4, worker_memory_bytes=budget) as h:
            a = await deploy(h, "a", 1, keep_alive_s=5.0, max_instances=2)
            h.controller.notify_demand(a, 8)
            await h.tick()
            await h.tick()
            instances = [i["instance_id"] for i in h.controller.get_model(a)["instances"]]
            assert len(instances) == 2
            h.controller.notify_demand(a, 0)
            await h.tick(1.0)
            await h.tick(6.0)
            await h.tick(6.0)
            await eventually(lambda: sorted(h.cluster.slept_workers) == sorted(instances), "both asleep")
            b = "acme/b"
            h.cluster.model_bytes["acme--b"] = MODEL_BYTES
            await h.controller.deploy({**spec(b, h.source("b", 2), keep_alive_s=60.0), "kv_cache_bytes": 400 * MIB})
            h.controller.notify_demand(b, 1)
            await h.tick()
            assert h.routes(b) != []
            h.controller.notify_demand(a, 8)
            await h.tick()
            assert len(h.cluster.woken_workers) == 1
            stopped = [d["instance_id"] for d in kinds(h, "stop") if d["instance_id"] in instances]
            assert stopped == [i for i in instances if i not in h.cluster.woken_workers]

    asyncio.run(scenario())


def test_a_sleeper_adopted_by_a_restarted_controller_holds_its_weights_and_wakes_only_where_its_kv_fits(tmp_path):
    """A controller restart adopts a sleeping worker (record "asleep"); once its model's size is
    known it is priced like any instance: weights plus KV pool, the KV part freed while asleep."""

    async def scenario():
        cluster = FakeCluster((RAY_NODE,))
        first = Harness(tmp_path, cluster=cluster, cpu_worker_slots_per_node=4, worker_memory_bytes=1100 * MIB)
        await first.controller.start()
        a, instance_id = await asleep_model(first, "a", 1)
        for task in list(first.controller._instances._tasks):  # killed: no shutdown
            task.cancel()
        await settle()

        second = Harness(tmp_path, cluster=cluster, cpu_worker_slots_per_node=4, worker_memory_bytes=1100 * MIB)
        second.clock.now = first.clock.now
        async with second:
            await second.tick()  # the model's size is read, and the adopted sleeper priced
            [instance] = second.controller.get_model(a)["instances"]
            assert (instance["instance_id"], instance["state"]) == (instance_id, "asleep")
            assert instance["held_memory_bytes"] == MODEL_BYTES  # weights alone: its KV pool's part is known
            [node] = second.controller.status()["nodes"]
            assert node["worker_memory"]["used_bytes"] == MODEL_BYTES
            second.controller.notify_demand(a, 1)
            await second.tick()
            await eventually(lambda: second.routes(a) == [instance_id], "the adopted sleeper woken")
            [node] = second.controller.status()["nodes"]
            assert node["worker_memory"]["used_bytes"] == MODEL_BYTES + KV  # its KV pool counted again

    asyncio.run(scenario())
