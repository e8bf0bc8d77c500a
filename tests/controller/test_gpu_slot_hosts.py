"""Memory is the slot on GPU nodes too (issue 38, Builds 1, 2, 4 and 5, the GPU form), as exact
decisions: with `gpu_memory_bytes` and `models_per_process` a GPU node has `models_per_process`
slots per GPU and a budget of `gpu_memory_bytes` per GPU; each GPU's slot host owns it
(``num_gpus=1``); an instance is fitted into one host's GPU memory, best fit; a sleeper on a GPU
holds no device memory but keeps its place in its host; evicting it frees that place; and a model
the node's hosts cannot take waits with a reason instead of starting a process that would wait
for a GPU the hosts hold."""

from __future__ import annotations

import asyncio

import pytest

from controller.cluster_node import ClusterNode, PlannedNode, RayNodeInfo, free_memory_bytes, plan_nodes
from controller.eviction_policy import EvictionCandidate
from controller.managed_instance import ManagedInstance
from controller.spare_pool import SparePool
from tests.controller.fake_cluster import FakeCluster
from tests.controller.test_controller import RAY_NODE, Harness, eventually, make_config, spec
from tests.controller.test_eviction_policy import evict, idle
from wire import InstanceState

GIB = 1 << 30
GPU_NODE = ClusterNode("gpu1", "r-gpu1", num_slots=5, num_gpus=1, accelerator="H200")


def test_a_gpu_budget_needs_slot_hosts_and_gives_each_gpu_their_places(tmp_path):
    with pytest.raises(ValueError, match=r"gpu_memory_bytes shares a GPU's memory .* needs models_per_process >= 2"):
        make_config(tmp_path, gpu_memory_bytes=GIB)
    with pytest.raises(ValueError, match="gpu_memory_bytes must be"):
        make_config(tmp_path, gpu_memory_bytes=0, models_per_process=4)
    assert make_config(tmp_path).slots_per_gpu == 1
    assert make_config(tmp_path, models_per_process=4).slots_per_gpu == 1  # no GPU budget: a GPU per model
    config = make_config(tmp_path, models_per_process=5, gpu_memory_bytes=40 * GIB)
    assert (config.hosts_gpu_models, config.slots_per_gpu) == (True, 5)
    nodes = [RayNodeInfo("b" * 56, num_gpus=2, accelerator="H200"), RayNodeInfo("a" * 56)]
    assert plan_nodes(nodes, 1, 3, slots_per_gpu=5) == [
        PlannedNode("a" * 16, "a" * 56, 3), PlannedNode("b" * 16, "b" * 56, 10, num_gpus=2, accelerator="H200")]


def test_a_gpu_sleeper_holds_no_device_memory_but_keeps_its_place(tmp_path):
    config = make_config(tmp_path, models_per_process=5, gpu_memory_bytes=40 * GIB)
    no_budget = make_config(tmp_path)

    def instance(instance_id: str, memory: int, kv: int, phase=InstanceState.READY, **fields) -> ManagedInstance:
        return ManagedInstance(instance_id, "acme/m", "gpu1", "r-gpu1", "host", 1, "acme--m", phase=phase,
                               memory_bytes=memory, kv_memory_bytes=kv, sleeps_to_host=True, **fields)

    awake = instance("awake", 18 * GIB, 2 * GIB)
    sleeper = instance("sleeper", 18 * GIB, 2 * GIB, InstanceState.ASLEEP)
    assert free_memory_bytes(GPU_NODE, [awake, sleeper], config) == 22 * GIB  # the sleeper's weights: host memory
    assert free_memory_bytes(GPU_NODE, [awake], no_budget) is None  # no GPU budget: slots alone
    assert (sleeper.held_memory_bytes, sleeper.wake_memory_bytes, sleeper.holds_slot) == (0, 18 * GIB, True)
    assert (awake.held_memory_bytes, awake.wake_memory_bytes, awake.holds_slot) == (18 * GIB, 0, True)
    cpu_sleeper = ManagedInstance("cpu", "acme/m", "cpu0", "r", "w", 1, "acme--m", phase=InstanceState.ASLEEP,
                                  memory_bytes=3 * GIB, kv_memory_bytes=GIB)
    assert (cpu_sleeper.held_memory_bytes, cpu_sleeper.wake_memory_bytes, cpu_sleeper.holds_slot) == (
        2 * GIB, GIB, False)  # the CPU form: weights kept, no slot
    assert sleeper.to_dict()["sleeps_to_host"] is True


def test_evicting_a_gpu_sleeper_frees_its_place_in_the_host():
    # Every place taken (0 free slots): a CPU sleeper frees none and is kept; a GPU sleeper keeps
    # its place in its slot host, so dropping it makes room (it frees no device memory: none needed).
    cpu_sleeper = idle("cpu", "acme/c", asleep=True, memory_bytes=100)
    gpu_sleeper = idle("gpu", "acme/g", asleep=True, holds_slot=True, memory_bytes=0)
    assert evict([cpu_sleeper], free_slots_by_node={"n0": 0}).victim is None
    decision = evict([cpu_sleeper, gpu_sleeper], free_slots_by_node={"n0": 0}, memory_bytes=GIB,
                     free_memory_by_node={"n0": 2 * GIB})
    assert decision.victims == (gpu_sleeper,)
    assert decision.reason.startswith("evict asleep gpu (acme/g, priority 0, idle 60.0s) on n0 for acme/cold")
    two_slots = evict([gpu_sleeper], free_slots_by_node={"n0": 0}, num_slots=2)
    assert two_slots.victim is None and "gpu (acme/g): asleep, it frees 1 of the 2 slots needed" in two_slots.reason
    with pytest.raises(ValueError, match="holds_slot must be True or False"):
        EvictionCandidate(instance_id="x", model_id="acme/x", node_id="n0", idle_s=1.0, reload_s=1.0,
                          holds_slot=False)  # an awake instance always holds its slot


def test_a_gpu_host_takes_an_instance_only_where_its_gpu_memory_fits_it_best_fit():
    async def scenario():
        cluster = FakeCluster((RAY_NODE,))
        cluster.spares_warm.set()
        pool = SparePool(cluster, 1, 5.0, host_models=3)
        assert pool.replenish([RAY_NODE], hosts={RAY_NODE: 6}, in_use={}, gpu_ray_node_ids={RAY_NODE}) == []
        assert [s.num_gpus for s in cluster.live_spares()] == [1, 1]  # a host per GPU, each owning it
        await eventually(lambda: pool.counts()[RAY_NODE]["warm"] == 2, "2 warm GPU hosts")
        first, second = (s.actor_name for s in pool.hosts())
        held = {"big": 30 * GIB}
        room = {"capacity_bytes": 40 * GIB, "held_bytes": held}
        assert pool.host_for(RAY_NODE, "big", 30 * GIB, **room).actor_name == first  # both empty: the smaller name
        # 8 GiB fits both; best fit is the fuller GPU (10 GiB left), keeping the empty one for a big model.
        held["small"] = 8 * GIB
        assert pool.host_for(RAY_NODE, "small", 8 * GIB, **room).actor_name == first
        assert pool.can_host(RAY_NODE, 3 * GIB, **room).actor_name == second  # 2 GiB left on the first
        assert pool.can_host(RAY_NODE, 41 * GIB, **room) is None  # bigger than a GPU's budget
        held["small"] = 0  # asleep: its weights in host memory, its place still taken
        assert pool.can_host(RAY_NODE, 10 * GIB, **room).actor_name == first
        assert pool.host_for(RAY_NODE, "third", 1 * GIB, **room).actor_name == first
        assert pool.can_host(RAY_NODE, 1 * GIB, **room).actor_name == second  # the first holds its 3
        # CPU hosts (no capacity of their own) keep the fewest-first rule.
        assert pool.can_host(RAY_NODE, 100 * GIB).actor_name == second
        await pool.close()

    asyncio.run(scenario())


def test_a_gpu_node_shared_by_memory_starts_a_host_per_gpu_and_a_model_waits_for_one(tmp_path):
    """The controller end: a one-GPU node with a GPU budget gets one slot host owning its GPU; a
    model asking for a GPU waits while the host is not warm (the reason says so) and starts no
    process of its own; a model asking for two GPUs is told it cannot be hosted."""
    cluster = FakeCluster((RAY_NODE,))
    cluster.ray_nodes = [RayNodeInfo(RAY_NODE, num_gpus=1, accelerator="H200")]

    async def scenario():
        async with Harness(tmp_path, cluster=cluster, models_per_process=4, gpu_memory_bytes=40 * GIB) as h:
            data = spec("acme/m1", h.source("m1"))
            data["resources"] = {"num_gpus": 1}
            await h.controller.deploy(data)
            h.controller.notify_demand("acme/m1", 1)
            await h.tick()
            await h.tick()
            [host] = h.cluster.live_spares()
            assert host.num_gpus == 1
            [node] = h.controller.status()["nodes"]
            assert (node["num_slots"], node["worker_memory"]["budget_bytes"]) == (4, 40 * GIB)
            model = h.controller.get_model("acme/m1")
            assert model["instances"] == [] and h.cluster.num_started_workers == 0
            assert model["last_placement"]["reason"].startswith(
                f"no warm slot host on node {node['node_id']} has a place and ")
            assert model["last_placement"]["reason"].endswith("for acme/m1 (hosts still starting, or each GPU's "
                                                              "models leave too little); it waits for one")
            wide = spec("acme/m2", h.source("m2"))
            wide["resources"] = {"num_gpus": 2}
            await h.controller.deploy(wide)
            h.controller.notify_demand("acme/m2", 1)
            await h.tick()
            reason = h.controller.get_model("acme/m2")["last_placement"]["reason"]
            assert reason.startswith("no node with 2 GPUs")  # one GPU here; on a larger node: one GPU a model
            assert h.cluster.num_started_workers == 0

    asyncio.run(scenario())


def test_the_longest_asleep_give_way_when_host_memory_for_sleepers_runs_short():
    from controller.host_sleep_policy import HostSleeper, room_for_sleeper

    sleepers = [HostSleeper("b", 6 * GIB, asleep_s=20.0), HostSleeper("a", 6 * GIB, asleep_s=10.0),
                HostSleeper("c", 2 * GIB, asleep_s=10.0)]
    room = room_for_sleeper("new", 4 * GIB, sleepers, 20 * GIB)  # 14 held + 4 fits
    assert (room.fits, room.dropped) == (True, ())
    assert room.reason == "18 GiB of the sleepers' 20 GiB of host memory held with new"
    room = room_for_sleeper("new", 8 * GIB, sleepers, 20 * GIB)  # 22: the longest asleep ("a", then "c") go
    assert (room.fits, room.dropped) == (True, ("a",))
    assert room.reason == ("the longest asleep (a) stopped for new: the node's sleepers may hold 20 GiB of host "
                           "memory, 16 GiB with it")
    assert room_for_sleeper("new", 17 * GIB, sleepers, 20 * GIB).dropped == ("a", "c", "b")
    too_big = room_for_sleeper("new", 21 * GIB, sleepers, 20 * GIB)
    assert (too_big.fits, too_big.dropped) == (False, ())
    assert too_big.reason == ("its weights (21 GiB) exceed the 20 GiB of host memory this node's sleepers may hold "
                              "(gpu_sleep_memory_bytes)")
    assert room_for_sleeper("new", 0, [], 0).fits  # nothing to hold


def test_the_sleepers_host_memory_defaults_to_the_gpu_budget(tmp_path):
    config = make_config(tmp_path, models_per_process=4, gpu_memory_bytes=40 * GIB)
    assert config.sleep_host_bytes_per_gpu == 40 * GIB
    assert make_config(tmp_path, models_per_process=4, gpu_memory_bytes=40 * GIB,
                       gpu_sleep_memory_bytes=0).sleep_host_bytes_per_gpu == 0
    with pytest.raises(ValueError, match="gpu_sleep_memory_bytes must be"):
        make_config(tmp_path, gpu_sleep_memory_bytes=-1)


async def gpu_model(h: Harness, name: str, seed: int) -> str:
    """Deploys `name` on one GPU with a 5 s keep-alive (MODEL_BYTES of weights)."""
    from tests.controller.test_controller import MODEL_BYTES

    model_id = f"acme/{name}"
    h.cluster.model_bytes[f"acme--{name}"] = MODEL_BYTES
    data = spec(model_id, h.source(name, seed), keep_alive_s=5.0)
    data["resources"] = {"num_gpus": 1}
    await h.controller.deploy(data)
    return model_id


async def served_then_idle(h: Harness, model_id: str) -> str:
    """Serves `model_id` once through its GPU host, then lets its keep-alive pass; returns its instance."""
    h.controller.notify_demand(model_id, 1)
    await h.tick()
    await eventually(lambda: h.routes(model_id) != [], f"{model_id} routed")
    [instance] = h.controller.get_model(model_id)["instances"]
    h.controller.notify_demand(model_id, 0)
    await h.tick(1.0)
    await h.tick(6.0)  # past its keep-alive: scaled to zero
    return instance["instance_id"]


def test_a_gpu_model_loads_into_its_gpu_s_host_sleeps_in_host_memory_and_wakes_there(tmp_path):
    """Through the controller (a fake cluster whose slot host holds fake instances): no process
    is started for the model; asleep it holds none of the GPU's budget and keeps its place; its
    next demand wakes the same instance; and when a second sleeper's weights would overflow the
    host memory for sleepers, the longest asleep is stopped for it."""
    from tests.controller.test_controller import MODEL_BYTES
    from tests.controller.test_instance_sleep import KV
    from tests.controller.test_slot_sharer import kinds

    cluster = FakeCluster((RAY_NODE,))
    cluster.ray_nodes = [RayNodeInfo(RAY_NODE, num_gpus=1, accelerator="H200")]
    cluster.spares_warm.set()

    async def scenario():
        async with Harness(tmp_path, cluster=cluster, models_per_process=3, gpu_memory_bytes=8 * GIB,
                           gpu_sleep_memory_bytes=MODEL_BYTES + MODEL_BYTES // 2) as h:
            a = await gpu_model(h, "a", 1)
            b = await gpu_model(h, "b", 2)
            await h.tick()
            await eventually(lambda: h.controller.status()["spare_workers"].get(RAY_NODE, {}).get("warm") == 1,
                             "the GPU's host warm")
            [host] = h.cluster.live_spares()
            a_id = await served_then_idle(h, a)
            assert h.cluster.num_started_workers == 0 and h.cluster.assigned_spares == [host.actor_name]
            assert h.cluster.hosted[a_id].num_gpus == 1  # on the host's GPU
            await eventually(lambda: a_id in h.cluster.slept_workers, "a asleep")
            [instance] = h.controller.get_model(a)["instances"]
            assert (instance["state"], instance["held_memory_bytes"], instance["sleeps_to_host"]) == ("asleep", 0, True)
            [node] = h.controller.status()["nodes"]
            assert (node["worker_memory"]["used_bytes"], node["num_free_slots"]) == (0, 2)  # its place kept
            [sleep] = kinds(h, "sleep")
            assert sleep["reason"] == "scaling down to 0; asleep rather than stopped, its weights moved to host memory"

            h.controller.notify_demand(a, 1)
            await h.tick()
            await eventually(lambda: h.routes(a) == [a_id], "a routed again")
            assert h.cluster.woken_workers == [a_id]
            [node] = h.controller.status()["nodes"]
            assert node["worker_memory"]["used_bytes"] == MODEL_BYTES + KV
            h.controller.notify_demand(a, 0)
            await h.tick(1.0)
            await h.tick(6.0)
            await eventually(lambda: h.cluster.slept_workers == [a_id, a_id], "a asleep again")

            # b's weights beside a's would pass the 1.5 models of host memory for sleepers: a goes.
            b_id = await served_then_idle(h, b)
            await eventually(lambda: b_id in h.cluster.slept_workers, "b asleep")
            assert h.cluster.stopped_workers == [a_id]
            stop = next(d for d in h.controller.status()["recent_decisions"]
                        if d["kind"] == "stop" and d["instance_id"] == a_id)
            assert stop["reason"].startswith(f"the longest asleep ({a_id}) stopped for {b_id}: the node's sleepers "
                                             f"may hold ")

    asyncio.run(scenario())
