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
from controller.managed_instance import InstancePhase, ManagedInstance
from controller.spare_pool import SparePool
from tests.controller.fake_cluster import FakeCluster
from tests.controller.test_controller import RAY_NODE, Harness, eventually, make_config, spec
from tests.controller.test_eviction_policy import evict, idle

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

    def instance(instance_id: str, memory: int, kv: int, phase=InstancePhase.READY, **fields) -> ManagedInstance:
        return ManagedInstance(instance_id, "acme/m", "gpu1", "r-gpu1", "host", 1, "acme--m", phase=phase,
                               memory_bytes=memory, kv_memory_bytes=kv, sleeps_to_host=True, **fields)

    awake = instance("awake", 18 * GIB, 2 * GIB)
    sleeper = instance("sleeper", 18 * GIB, 2 * GIB, InstancePhase.ASLEEP)
    assert free_memory_bytes(GPU_NODE, [awake, sleeper], config) == 22 * GIB  # the sleeper's weights: host memory
    assert free_memory_bytes(GPU_NODE, [awake], no_budget) is None  # no GPU budget: slots alone
    assert (sleeper.held_memory_bytes, sleeper.wake_memory_bytes, sleeper.holds_slot) == (0, 18 * GIB, True)
    assert (awake.held_memory_bytes, awake.wake_memory_bytes, awake.holds_slot) == (18 * GIB, 0, True)
    cpu_sleeper = ManagedInstance("cpu", "acme/m", "cpu0", "r", "w", 1, "acme--m", phase=InstancePhase.ASLEEP,
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
