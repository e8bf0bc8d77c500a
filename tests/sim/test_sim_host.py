"""Slot hosts in the simulator (`sim.sim_host`): a GPU's memory is the slot, co-resident models'
decode steps take turns, and a GPU is counted once however many models it holds.

The scenarios are the hand-computed ones of test_policies.py (one node, 2 GB models, the cost
model's own functions for the expected times), with the node's GPUs as slot hosts.
"""

import pytest

from sim.cost_model import H100
from sim.event_loop import EventLoop
from sim.policies import PolicySettings
from sim.policy_factory import make_policy
from sim.cluster_spec import ClusterSpec
from sim.sim_cluster import SimCluster
from sim.sim_models import SimModel
from sim.simulator import SimConfig
from sim.tick_scheduler import TickScheduler
from tests.sim.test_policies import COST, MODEL_A, MODEL_B, PROMPT, arrive, prefill_s

MODEL_C = SimModel(model_id="c", family="llama", params_b=1.0, weight_bytes=2_000_000_000)
SHARE = COST.instance_memory_bytes(MODEL_A, H100, ClusterSpec(num_nodes=1, gpus_per_node=1).kv_pool_tokens)
TWO_PER_GPU = 2 * SHARE + SHARE // 2  # room for two 2 GB models and their KV pools, not three


def build(models, *, gpus=1, models_per_gpu=4, gpu_memory_bytes=TWO_PER_GPU, policy="thaw"):
    loop = EventLoop()
    spec = ClusterSpec(num_nodes=1, gpus_per_node=gpus, start_overhead_s=0.0, models_per_gpu=models_per_gpu,
                       gpu_memory_bytes=gpu_memory_bytes if models_per_gpu > 1 else None)
    cluster = SimCluster(spec, models, COST, H100, loop)
    chosen = make_policy(policy, PolicySettings())
    ticks = TickScheduler(loop, 1.0, chosen.tick)
    cluster.attach(chosen)
    chosen.attach(cluster, ticks)
    for index in range(len(models)):
        cluster.preload(0, index, "dram")
    return loop, cluster, chosen


def test_an_instance_takes_its_weights_and_kv_pool_of_a_gpu_best_fit_and_a_gpu_counts_once():
    loop, cluster, _ = build([MODEL_A, MODEL_B, MODEL_C], gpus=2)
    node = cluster.nodes[0]
    assert SHARE == MODEL_A.weight_bytes + COST._shape(MODEL_A)[2] * 64 * 512  # weights + a 32,768-token pool
    a = cluster.start_instance(0, 0, "dram")
    b = cluster.start_instance(1, 0, "dram")
    # b goes where a is (the fullest GPU that fits it), keeping GPU 1 whole for a larger model.
    assert [h.index for h in a.hosts] == [0] and [h.index for h in b.hosts] == [0]
    assert cluster.room(node, 2) == 1  # GPU 0's memory is taken, GPU 1 is free
    c = cluster.start_instance(2, 0, "dram")
    assert [h.index for h in c.hosts] == [1] and cluster.room(node, 2) == 1
    c2 = cluster.start_instance(2, 0, "dram")
    assert [h.index for h in c2.hosts] == [1] and cluster.room(node, 2) == 0
    with pytest.raises(ValueError, match="has room for 0 of the 1 slots c needs"):
        cluster.start_instance(2, 0, "dram")
    # Stopping a would make room on GPU 0 for another c, stopping c2 on GPU 1.
    assert cluster.slots_freed_for(a, 2) == 1 and cluster.slots_freed_for(c2, 0) == 1
    assert cluster.num_used_slots == 2  # GPUs in use, not instances
    cluster.close(10.0)
    assert cluster.accelerator_s == pytest.approx(2 * 10.0)  # two GPUs for 10 s, not four instances


def test_a_freed_slot_on_a_gpu_that_already_has_room_adds_none():
    loop, cluster, _ = build([MODEL_A, MODEL_B], models_per_gpu=4, gpu_memory_bytes=4 * SHARE)
    a = cluster.start_instance(0, 0, "dram")
    assert cluster.room(cluster.nodes[0], 1) == 1
    assert cluster.slots_freed_for(a, 1) == 0  # b's share fits GPU 0 already: stopping a frees nothing for it


def test_a_second_model_joins_a_busy_gpu_instead_of_evicting_its_model():
    """The eviction scenario of test_policies.py (a busy then idle on the only GPU, b arriving):
    one model per GPU, b evicts a; as slot hosts, b is loaded beside a and nothing is evicted."""
    for models_per_gpu, evictions in ((1, 1), (2, 0)):
        loop, cluster, _ = build([MODEL_A, MODEL_B], models_per_gpu=models_per_gpu)
        arrive(loop, cluster, 0.0, 0, 0)
        arrive(loop, cluster, 20.0, 1, 1)
        loop.run()
        assert cluster.counts["evictions"] == evictions
        assert cluster.ttft_s[1] == pytest.approx(COST.load_s(MODEL_B.weight_bytes, "dram") + prefill_s(MODEL_B),
                                                  abs=1e-9)


def test_co_resident_decode_steps_take_turns():
    """b decodes while a does on the same GPU: each of b's steps waits for one of a's. With a GPU
    each (one model per GPU) b's steps are its own."""
    finishes = {}
    for models_per_gpu, gpus in ((2, 1), (1, 2)):
        loop, cluster, _ = build([MODEL_A, MODEL_B], gpus=gpus, models_per_gpu=models_per_gpu)
        arrive(loop, cluster, 0.0, 0, 0, output_tokens=5000)  # a decodes all through b's request
        arrive(loop, cluster, 1.0, 1, 1, output_tokens=10)
        loop.run()
        assert cluster.finish_s[0] > cluster.finish_s[1]
        finishes[models_per_gpu] = cluster.finish_s[1] - 1.0 - cluster.ttft_s[1]  # b's 9 decode steps
    step_a = COST.decode_step_s(MODEL_A, H100, 1, PROMPT + 5000 / 2)
    step_b = COST.decode_step_s(MODEL_B, H100, 1, PROMPT + 10 / 2)
    assert finishes[1] == pytest.approx(9 * step_b, rel=1e-9)
    assert finishes[2] == pytest.approx(9 * (step_b + step_a), rel=1e-9)


def test_a_model_evicts_an_idle_one_only_where_that_frees_the_memory_it_needs():
    """Two idle models fill GPU 0's memory; c arrives: one of them is evicted for it (an idle
    instance's memory, not a whole GPU, is what it needs) and c is served from DRAM at once."""
    loop, cluster, _ = build([MODEL_A, MODEL_B, MODEL_C])
    arrive(loop, cluster, 0.0, 0, 0)
    arrive(loop, cluster, 0.0, 1, 1)
    arrive(loop, cluster, 20.0, 2, 2)
    loop.run()
    assert cluster.counts["evictions"] == 1
    assert cluster.ttft_s[2] == pytest.approx(COST.load_s(MODEL_C.weight_bytes, "dram") + prefill_s(MODEL_C),
                                              abs=1e-9)


def test_slot_host_settings_are_checked_with_what_to_change():
    with pytest.raises(ValueError, match="give gpu_memory_bytes"):
        ClusterSpec(num_nodes=1, gpus_per_node=1, models_per_gpu=2)
    with pytest.raises(ValueError, match="models_per_gpu must be an integer >= 1"):
        ClusterSpec(num_nodes=1, gpus_per_node=1, models_per_gpu=0)
    with pytest.raises(ValueError, match=r"takes 2\.\d GiB of each of its GPUs .* more than the slot host's 1\.0 GiB"):
        build([MODEL_A], gpu_memory_bytes=1 << 30)
    with pytest.raises(ValueError, match="thaw_models_per_gpu must be"):
        SimConfig(num_models=2, num_nodes=1, thaw_models_per_gpu=0)
    # Only Thaw's GPUs are slot hosts: the peers' cluster keeps one model per GPU.
    config = SimConfig(num_models=2, num_nodes=1, thaw_models_per_gpu=8)
    assert config.cluster_spec(0.0, 72 << 30).models_per_gpu == 8
    peer = SimConfig(num_models=2, num_nodes=1, thaw_models_per_gpu=8, policy="serverlessllm")
    assert peer.cluster_spec(0.0, 72 << 30).models_per_gpu == 1
