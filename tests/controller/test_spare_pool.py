"""Spare workers through the controller (fake cluster, fake clock): a cold start takes a warm
spare on its node, the pool refills once the node has settled, GPU models never take one, a spare
that dies is replaced, and shutdown or a restart leaves none behind."""

from __future__ import annotations

import asyncio

from controller.cluster_node import RayNodeInfo
from tests.controller.fake_cluster import FakeCluster
from tests.controller.test_controller import NODE, RAY_NODE, Harness, eventually, spec


def test_a_cold_start_takes_a_warm_spare_and_the_pool_refills(tmp_path):
    async def scenario():
        async with Harness(tmp_path, spare_workers_per_node=1, spare_weight_bytes=3 << 20,
                           engine_defaults={"kv_cache_bytes": 2 << 20}) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1")))
            await h.tick()
            [spare] = h.cluster.live_spares()  # started on the first tick, not yet warm
            assert spare.actor_name.startswith("thaw-worker-spare-")
            assert h.controller.status()["spare_workers"] == {RAY_NODE: {"warm": 0, "starting": 1}}

            h.controller.notify_demand("acme/m1", 1)
            await h.tick()  # the spare is not warm: a fresh worker starts instead of waiting for it
            assert h.cluster.num_started_workers == 1 and h.cluster.assigned_spares == []
            await h.controller.scale("acme/m1", min_instances=0, max_instances=2)

            h.cluster.spares_warm.set()
            await eventually(lambda: h.controller.status()["spare_workers"] == {RAY_NODE: {"warm": 1, "starting": 0}},
                             "the spare to be warm")
            assert spare.reserved_bytes == (3 << 20, 2 << 20)  # warmed with the weight and KV reservations
            h.controller.notify_demand("acme/m1", 4)
            await h.tick()  # a second instance: the warm spare serves it, no process is started
            await eventually(lambda: len(h.routes("acme/m1")) == 2, "both instances routed")
            assert h.cluster.num_started_workers == 1 and h.cluster.assigned_spares == [spare.actor_name]
            from_spare = [i for i in h.controller.status()["instances"] if i["from_spare"]]
            assert [i["actor_name"] for i in from_spare] == [spare.actor_name]
            assert spare.model_id == "acme/m1" and spare.model_dir == f"/fake/{NODE}/ssd/acme--m1"
            assert spare.num_threads == 1 and spare.engine_config is not None
            assert h.records()[from_spare[0]["instance_id"]] == "ready"  # recorded under the spare's name
            await h.tick(advance_s=4.9)  # its replacement waits until the new instance has been ready 5 s
            assert h.cluster.live_spares() == []  # (a spare's start would compete with its first requests)
            await h.tick(advance_s=0.1)
            [replacement] = h.cluster.live_spares()
            assert replacement.actor_name != spare.actor_name

    asyncio.run(scenario())


def test_a_gpu_model_never_takes_a_spare_and_zero_spares_starts_none(tmp_path):
    async def scenario():
        async with Harness(tmp_path, spare_workers_per_node=0) as h:
            await h.tick()
            assert h.cluster.live_spares() == [] and h.controller.status()["spare_workers"] == {}
        cluster = FakeCluster((RAY_NODE,))
        cluster.spares_warm.set()
        cluster.ray_nodes = [RayNodeInfo(RAY_NODE, num_gpus=1)]
        async with Harness(tmp_path / "gpu", cluster=cluster) as h:
            data = spec("acme/m1", h.source("m1"))
            data["resources"] = {"num_gpus": 1}
            await h.controller.deploy(data)
            await h.tick()
            await eventually(lambda: h.controller.status()["spare_workers"][RAY_NODE]["warm"] == 1, "a warm spare")
            h.controller.notify_demand("acme/m1", 1)
            await h.tick()
            assert h.cluster.num_started_workers == 1 and h.cluster.assigned_spares == []

    asyncio.run(scenario())


def test_a_spare_that_dies_before_its_model_arrives_fails_the_start_and_is_replaced(tmp_path):
    async def scenario():
        cluster = FakeCluster((RAY_NODE,))
        cluster.spares_warm.set()
        async with Harness(tmp_path, cluster=cluster) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1")))
            await h.tick()
            await eventually(lambda: h.controller.status()["spare_workers"].get(RAY_NODE, {}).get("warm") == 1,
                             "a warm spare")
            [spare] = h.cluster.live_spares()
            spare.alive = False  # dies between warm() and assign()
            h.controller.notify_demand("acme/m1", 1)
            await h.tick()
            await eventually(lambda: any(d["kind"] == "start_failed" for d in h.controller.status()["recent_decisions"]
                                         if "kind" in d), "the failed start to be recorded")
            assert h.routes("acme/m1") == [] and h.records() == {}
            await h.tick(advance_s=5.0)  # after the back-off: a fresh start (its replacement spare is warm too)
            await eventually(lambda: len(h.routes("acme/m1")) == 1, "the model to be served again")

    asyncio.run(scenario())


def test_shutdown_ends_the_spares_and_a_restart_ends_leftover_ones(tmp_path):
    async def scenario():
        cluster = FakeCluster((RAY_NODE,))
        async with Harness(tmp_path, cluster=cluster) as h:
            await h.tick()
            [spare] = cluster.live_spares()
        assert not spare.alive  # shutdown (even leaving workers running) ends the spares
        leftover = cluster.start_spare_worker(actor_name="thaw-worker-spare-leftover", ray_node_id=RAY_NODE)
        async with Harness(tmp_path, cluster=cluster):
            assert not leftover.alive and cluster.killed_spares == ["thaw-worker-spare-leftover"]

    asyncio.run(scenario())


def test_where_memory_is_the_slot_a_node_keeps_a_warm_process_per_slot_its_instances_do_not_hold(tmp_path):
    """4 slots sharing a budget: 4 warm processes from the first tick; an instance takes one and no
    spare replaces it (the instance's process is one of the 4), asleep it still holds it, and a
    second model takes another warm one: no process started for either."""
    async def scenario():
        async with Harness(tmp_path, spare_workers_per_node=1, cpu_worker_slots_per_node=4,
                           worker_memory_bytes=4 << 30) as h:
            h.cluster.spares_warm.set()
            for name in ("m1", "m2"):
                h.cluster.model_bytes[f"acme--{name}"] = 1_000_000
                await h.controller.deploy(spec(f"acme/{name}", h.source(name), keep_alive_s=5.0))
            await h.tick()
            assert len(h.cluster.live_spares()) == 4
            await eventually(lambda: h.controller.status()["spare_workers"] == {RAY_NODE: {"warm": 4, "starting": 0}},
                             "4 warm processes")
            h.controller.notify_demand("acme/m1", 1)
            await h.tick()
            await eventually(lambda: h.routes("acme/m1") != [], "m1 routed")
            h.controller.notify_demand("acme/m1", 0)
            await h.tick(advance_s=6.0)  # settled, past its keep-alive: asleep, still in its process
            await h.tick(advance_s=6.0)
            await eventually(lambda: len(h.cluster.slept_workers) == 1, "m1 asleep")
            assert h.controller.status()["spare_workers"] == {RAY_NODE: {"warm": 3, "starting": 0}}
            h.controller.notify_demand("acme/m2", 1)
            await h.tick()
            await eventually(lambda: h.routes("acme/m2") != [], "m2 routed")
            assert h.cluster.num_started_workers == 0 and len(h.cluster.assigned_spares) == 2
            assert h.controller.status()["worker_processes_started"] == {"spares": 4, "instances": 0}

    asyncio.run(scenario())


def test_slot_hosts_stay_in_the_pool_and_take_models_fewest_first_up_to_their_capacity():
    """`models_per_process` 2 on a node of 4 slots: 2 hosts; models go to the host holding the
    fewest; full hosts take none; a host is never taken out; closing for a successor keeps a host
    that holds instances."""
    from controller.spare_pool import SparePool

    async def scenario():
        cluster = FakeCluster((RAY_NODE,))
        cluster.spares_warm.set()
        pool = SparePool(cluster, 1, 5.0, host_models=2)
        assert pool.replenish([RAY_NODE], hosts={RAY_NODE: 4}, in_use={}) == []
        await eventually(lambda: pool.counts() == {RAY_NODE: {"warm": 2, "starting": 0, "hosted": 0}}, "2 warm hosts")
        assert pool.take(RAY_NODE) is None  # a host is never handed over whole
        placed = [pool.host_for(RAY_NODE, f"i{n}") for n in range(5)]
        names = [host.actor_name if host else None for host in placed]
        first, second = sorted(set(filter(None, names)))
        assert names == [first, second, first, second, None]  # fewest first, then the smaller name; full: none
        assert pool.counts()[RAY_NODE]["hosted"] == 4
        pool.unhost(first, "i0")
        assert pool.host_for(RAY_NODE, "i5").actor_name == first
        pool.replenish([RAY_NODE], hosts={RAY_NODE: 4}, in_use={})
        assert len(cluster.live_spares()) == 2  # hosts with models are still the pool's: none started
        pool.unhost(second, "i1")
        pool.unhost(second, "i3")
        await pool.close(keep_hosting=True)
        await eventually(lambda: [s.actor_name for s in cluster.live_spares()] == [first], "the empty host ended")

    asyncio.run(scenario())
