"""Which nodes a model's instances may run on by kind (`kind_refusal`, `nodes_of_kind`), as exact
decisions, and the controller acting on them: a GPU model never lands on a CPU node, a CPU model
never on a GPU node, and a model with no node of its kind is refused in words a user can act on."""

from __future__ import annotations

import asyncio

from controller.cluster_node import ClusterNode, PlannedNode, RayNodeInfo, kind_refusal, nodes_of_kind, plan_nodes
from controller.ray_cluster_client import accelerator_kind, live_ray_nodes
from tests.controller.fake_cluster import FakeCluster
from tests.controller.test_controller import SPLIT, Harness, spec
from wire import InstanceState

CPU = ClusterNode("cpu0", "r-cpu", num_slots=2)
ONE_GPU = ClusterNode("gpu1", "r-gpu1", num_slots=1, num_gpus=1, accelerator="H200")
EIGHT_GPUS = ClusterNode("gpu8", "r-gpu8", num_slots=8, num_gpus=8, accelerator="H100")


def test_each_kind_of_model_fits_only_its_kind_of_node():
    assert [kind_refusal(0, n) for n in (CPU, ONE_GPU, EIGHT_GPUS)] == [None, "a GPU node", "a GPU node"]
    assert [kind_refusal(1, n) for n in (CPU, ONE_GPU, EIGHT_GPUS)] == ["a CPU node", None, None]
    assert [kind_refusal(0.5, n) for n in (CPU, ONE_GPU, EIGHT_GPUS)] == ["a CPU node", None, None]  # a share of one
    assert [kind_refusal(2, n) for n in (CPU, ONE_GPU, EIGHT_GPUS)] == ["a CPU node", "1 GPU", None]


def test_nodes_of_kind_keeps_the_fitting_nodes_or_says_why_none():
    assert nodes_of_kind(0, [CPU, ONE_GPU, EIGHT_GPUS]) == ([CPU], None)
    assert nodes_of_kind(2, [CPU, ONE_GPU, EIGHT_GPUS]) == ([EIGHT_GPUS], None)
    assert nodes_of_kind(1, []) == ([], None)  # no node yet: placement says that itself
    fitting, why = nodes_of_kind(1, [CPU])
    assert fitting == [] and why == ("no node with 1 GPU: the model asks for 1 per instance (resources.num_gpus) "
                                     "and the 1 connected node(s) are a CPU node")
    fitting, why = nodes_of_kind(4, [CPU, ONE_GPU])
    assert fitting == [] and "asks for 4 per instance" in why and "1 GPU, a CPU node" in why
    fitting, why = nodes_of_kind(0, [ONE_GPU, EIGHT_GPUS])
    assert fitting == [] and why.startswith("no CPU node: the model runs on CPU") and "num_gpus > 0" in why


def test_a_ray_node_s_accelerator_kind_is_read_from_its_resources():
    assert accelerator_kind({"CPU": 16.0, "GPU": 1.0, "accelerator_type:H200": 1.0, "memory": 1e11}) == "H200"
    assert accelerator_kind({"CPU": 2.0, "memory": 1e10}) is None
    assert live_ray_nodes([  # ray.nodes()'s answer: dead nodes are left out
        {"NodeID": "g" * 56, "Alive": True, "Resources": {"CPU": 16.0, "GPU": 1.0, "accelerator_type:H200": 1.0}},
        {"NodeID": "c" * 56, "Alive": True, "Resources": {"CPU": 2.0}},
        {"NodeID": "d" * 56, "Alive": False, "Resources": {"CPU": 2.0}},
    ]) == [RayNodeInfo("g" * 56, num_gpus=1, accelerator="H200"), RayNodeInfo("c" * 56)]


def test_plan_nodes_gives_slots_per_gpu_or_per_config():
    nodes = [RayNodeInfo("b" * 56, num_gpus=4, accelerator="H200"), RayNodeInfo("a" * 56)]
    gpu_node = PlannedNode("b" * 16, "b" * 56, 4, num_gpus=4, accelerator="H200")
    assert plan_nodes(nodes, 1, 2) == [PlannedNode("a" * 16, "a" * 56, 2), gpu_node]
    assert plan_nodes(nodes[1:], 3, 1) == [PlannedNode(SPLIT[i], "a" * 56, 1) for i in range(3)]
    assert plan_nodes(nodes, 1, 2, excluded_ray_node_ids=["a" * 56]) == [gpu_node]  # --head-only


def test_the_controller_places_each_model_on_its_kind_and_refuses_a_model_without_one(tmp_path):
    async def scenario():
        cluster = FakeCluster(("a" * 56, "b" * 56))
        cluster.ray_nodes = [RayNodeInfo("a" * 56), RayNodeInfo("b" * 56, num_gpus=1, accelerator="H200")]
        async with Harness(tmp_path, cluster=cluster, spare_workers_per_node=0) as h:
            cpu_model, gpu_model, big_model = spec("acme/cpu", h.source("cpu")), spec("acme/gpu", h.source("gpu")), \
                spec("acme/big", h.source("big"))
            gpu_model["resources"] = {"num_gpus": 1}
            big_model["resources"] = {"num_gpus": 2, "num_worker_slots": 2}
            for data in (cpu_model, gpu_model, big_model):
                await h.controller.deploy(data)
            await h.tick()
            for model_id in ("acme/cpu", "acme/gpu", "acme/big"):
                h.controller.notify_demand(model_id, 1)
            await h.tick()
            placed = {i["model_id"]: i["node_id"] for i in h.controller.status()["instances"]}
            assert placed == {"acme/cpu": "a" * 16, "acme/gpu": "b" * 16}
            refusal = h.controller.get_model("acme/big")["last_placement"]
            assert refusal["node_id"] is None and refusal["reason"].startswith(
                "no node with 2 GPUs: the model asks for 2 per instance (resources.num_gpus) and the 2 connected "
                "node(s) are 1 GPU, a CPU node")

    asyncio.run(scenario())


def test_the_worker_memory_budget_is_a_cpu_nodes_and_counts_every_instance_until_it_is_gone(tmp_path):
    from controller.cluster_node import free_memory_bytes
    from controller.managed_instance import ManagedInstance
    from tests.controller.test_controller import make_config

    config = make_config(tmp_path, worker_memory_bytes=10_000)

    def held(instance_id: str, node_id: str, memory: int, phase=InstanceState.READY) -> ManagedInstance:
        return ManagedInstance(instance_id, "acme/m", node_id, "r", f"w-{instance_id}", 1, "acme--m",
                               phase=phase, memory_bytes=memory)

    instances = [held("a", "cpu0", 3_000), held("b", "cpu0", 2_000, InstanceState.STOPPING), held("c", "x", 9_000)]
    assert free_memory_bytes(CPU, instances, config) == 5_000  # a stopping instance holds its share
    assert free_memory_bytes(ONE_GPU, instances, config) is None  # device memory: not this budget
    assert free_memory_bytes(ClusterNode("cpu0", "r", 2, draining=True), instances, config) == 0
    assert free_memory_bytes(CPU, instances, make_config(tmp_path)) is None  # no budget configured
    # An asleep instance holds its weights alone (its KV pool's part freed) and no slot.
    sleeper = held("d", "cpu0", 3_000, InstanceState.ASLEEP)
    sleeper.kv_memory_bytes = 2_500
    assert free_memory_bytes(CPU, instances + [sleeper], config) == 4_500
    from controller.cluster_node import num_used_slots
    assert num_used_slots("cpu0", instances + [sleeper]) == 2
    # A sleeper being stopped (evicted, or its node without room to wake it) does not allocate its
    # KV pool again on its way out: still its weights alone, and no slot, until it is gone.
    sleeper.phase, sleeper.asleep_s = InstanceState.STOPPING, 12.0
    assert free_memory_bytes(CPU, instances + [sleeper], config) == 4_500
    assert num_used_slots("cpu0", instances + [sleeper]) == 2
    sleeper.asleep_s = None  # an awake instance stopping holds its whole share
    assert free_memory_bytes(CPU, instances + [sleeper], config) == 2_000
    assert num_used_slots("cpu0", instances + [sleeper]) == 3


def test_a_node_s_own_worker_memory_budget_wins_over_the_platform_s(tmp_path):
    """``thaw join --worker-memory-gb``: the node's store reports its own budget, and the controller
    places by it; a node without one keeps the platform's (here none: slots alone)."""
    from controller.cluster_node import worker_memory_budget
    from storage.node_settings import NodeSettings
    from storage.store_config import GIB
    from tests.controller.test_controller import make_config

    config = make_config(tmp_path)
    assert worker_memory_budget(CPU, config) is None
    cluster = FakeCluster(("a" * 56, "b" * 56))
    cluster.node_settings["a" * 56] = NodeSettings(worker_memory_bytes=3 * GIB)

    async def scenario():
        async with Harness(tmp_path / "h", cluster=cluster, cpu_worker_slots_per_node=2) as h:
            await h.tick()
            await h.tick()  # the stores' first reports
            nodes = {n["node_id"][0]: n for n in h.controller.status()["nodes"]}
            assert nodes["a"]["worker_memory"]["budget_bytes"] == 3 * GIB
            assert nodes["b"]["worker_memory"] is None
            await h.controller.deploy(spec("acme/m1", h.source("m1"), keep_alive_s=60.0))
            h.controller.notify_demand("acme/m1", 1)
            await h.tick()
            [worker] = h.cluster.live_workers()
            # Best fit under a budget ranks the budgeted node: it shares by memory, reserving no CPU.
            return worker.ray_node_id, worker.num_cpus

    ray_node_id, num_cpus = asyncio.run(scenario())
    assert (ray_node_id, num_cpus) == ("a" * 56, 0)


def test_the_loader_wait_counts_only_loads_from_disk_or_the_repository():
    """A load from the DRAM tier does not hold up the node's disk and network path (issue 39)."""
    from controller.cluster_node import loader_loads_s
    from controller.managed_instance import ManagedInstance

    def loading(instance_id: str, tier: str | None, estimate_s: float, node_id: str = "n0") -> ManagedInstance:
        return ManagedInstance(instance_id, "acme/m", node_id, "r", f"w-{instance_id}", 1, "acme--m",
                               phase=InstanceState.LOADING, tier=tier, estimate_s=estimate_s, started_s=100.0)

    instances = [loading("fetch", "ssd", 60.0), loading("warm", "dram", 2.0), loading("adopted", None, 5.0),
                 loading("elsewhere", "ssd", 30.0, node_id="n1")]
    assert loader_loads_s("n0", instances, now=110.0) == (50.0, 0.0)  # the adopted one's 5 s have passed
    assert loader_loads_s("n0", instances, now=101.0) == (59.0, 4.0)  # tier unknown: counted
    assert loader_loads_s("n1", instances, now=110.0) == (20.0,)
