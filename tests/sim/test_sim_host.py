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


def build(models, *, gpus=1, models_per_gpu=4, gpu_memory_bytes=TWO_PER_GPU, sleep=True, **spec):
    """One node of `gpus` slot hosts (one model per GPU with `models_per_gpu` 1), Thaw's policy,
    every checkpoint in the node's DRAM; `spec`: more `ClusterSpec` fields."""
    loop = EventLoop()
    spec = ClusterSpec(num_nodes=1, gpus_per_node=gpus, start_overhead_s=0.0, models_per_gpu=models_per_gpu,
                       gpu_memory_bytes=gpu_memory_bytes if models_per_gpu > 1 else None, **spec)
    cluster = SimCluster(spec, models, COST, H100, loop)
    policy = make_policy("thaw", PolicySettings(), thaw_sleep=sleep)
    ticks = TickScheduler(loop, 1.0, policy.tick)
    cluster.attach(policy)
    policy.attach(cluster, ticks)
    for index in range(len(models)):
        cluster.preload(0, index, "dram")
    return loop, cluster, policy


def test_an_instance_takes_its_weights_and_kv_pool_of_a_gpu_best_fit_and_a_gpu_counts_once():
    loop, cluster, _ = build([MODEL_A, MODEL_B, MODEL_C], gpus=2)
    node = cluster.nodes[0]
    assert SHARE == MODEL_A.weight_bytes + COST.kv_bytes_per_token(MODEL_A) * 64 * 512  # weights + a 32,768-token pool
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


def test_co_resident_decode_steps_take_turns_and_a_prefill_holds_the_neighbours_decode():
    """b decodes while a does on the same GPU: each of b's steps waits for one of a's, and b's
    prefill holds a's decode for its length. With a GPU each (one model per GPU) b's steps are its
    own and a never waits for b."""
    b_decode, a_finish = {}, {}
    for models_per_gpu, gpus in ((2, 1), (1, 2)):
        loop, cluster, _ = build([MODEL_A, MODEL_B], gpus=gpus, models_per_gpu=models_per_gpu)
        arrive(loop, cluster, 0.0, 0, 0, output_tokens=5000)  # a decodes all through b's request
        arrive(loop, cluster, 1.0, 1, 1, output_tokens=10)
        loop.run()
        assert cluster.finish_s[0] > cluster.finish_s[1]
        b_decode[models_per_gpu] = cluster.finish_s[1] - 1.0 - cluster.ttft_s[1]  # b's 9 decode steps
        a_finish[models_per_gpu] = cluster.finish_s[0]
    step_a = COST.decode_step_s(MODEL_A, H100, 1, PROMPT + 5000 / 2)
    step_b = COST.decode_step_s(MODEL_B, H100, 1, PROMPT + 10 / 2)
    assert b_decode[1] == pytest.approx(9 * step_b, rel=1e-9)
    assert b_decode[2] == pytest.approx(9 * (step_b + step_a), rel=1e-9)
    # a lost b's prefill and one of b's steps for each of the 9 it took its turn for.
    assert a_finish[2] - a_finish[1] == pytest.approx(prefill_s(MODEL_B) + 9 * step_b, rel=1e-6)


def test_prefills_on_one_gpu_take_it_one_after_another():
    """a and b resident on one GPU, a request for each at the same moment: b's prefill begins when
    a's has ended. With a GPU each they run at once."""
    ttft = {}
    for models_per_gpu, gpus in ((2, 1), (1, 2)):
        loop, cluster, _ = build([MODEL_A, MODEL_B], gpus=gpus, models_per_gpu=models_per_gpu)
        arrive(loop, cluster, 0.0, 0, 0, output_tokens=1)  # both loaded and idle by 30 s, within the keep-alive
        arrive(loop, cluster, 0.0, 1, 1, output_tokens=1)
        arrive(loop, cluster, 30.0, 2, 0, output_tokens=1)
        arrive(loop, cluster, 30.0, 3, 1, output_tokens=1)
        loop.run()
        assert cluster.cold_starts["dram"] == 2  # the requests at 30 s found their instances warm
        ttft[models_per_gpu] = (cluster.ttft_s[2], cluster.ttft_s[3])
    assert ttft[1] == pytest.approx((prefill_s(MODEL_A), prefill_s(MODEL_B)), abs=1e-9)
    assert ttft[2] == pytest.approx((prefill_s(MODEL_A), prefill_s(MODEL_A) + prefill_s(MODEL_B)), abs=1e-9)


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


def test_an_idle_instance_past_its_keep_alive_sleeps_and_its_next_request_wakes_it_over_the_link():
    wake_s = MODEL_A.weight_bytes / COST.host_link_Bps
    assert COST.wake_s(MODEL_A, H100) == pytest.approx(wake_s)
    for sleep, ttft in ((True, wake_s), (False, COST.load_s(MODEL_A.weight_bytes, "dram"))):
        loop, cluster, policy = build([MODEL_A], models_per_gpu=2, sleep=sleep)
        arrive(loop, cluster, 0.0, 0, 0, output_tokens=1)
        arrive(loop, cluster, 100.0, 1, 0, output_tokens=1)  # past the 60 s keep-alive
        loop.run()
        assert cluster.ttft_s[1] == pytest.approx(ttft + prefill_s(), abs=1e-9)
        # It slept after each request's keep-alive, and woke for the second.
        assert (cluster.counts["sleeps"], cluster.counts["wakes"]) == ((2, 1) if sleep else (0, 0))
        assert cluster.cold_starts["dram"] == (1 if sleep else 2)  # a wake is no cold start
        assert policy.describe()["sleep_idle_instances"] is sleep


def test_a_sleeper_holds_its_place_not_its_memory_and_a_gpu_of_sleepers_is_not_in_use():
    loop, cluster, _ = build([MODEL_A, MODEL_B, MODEL_C], models_per_gpu=2)
    node = cluster.nodes[0]
    arrive(loop, cluster, 0.0, 0, 0, output_tokens=1)
    arrive(loop, cluster, 0.0, 1, 1, output_tokens=1)
    loop.run(until_s=1.0)
    assert cluster.room(node, 2) == 0 and cluster.num_used_slots == 1  # both on GPU 0: its memory is taken
    loop.run(until_s=100.0)  # both asleep since their keep-alive ran out (~61 s)
    [a], [b] = cluster.models[0].sleepers, cluster.models[1].sleepers
    assert cluster.room(node, 2) == 0  # their memory is free, but both places are taken
    assert cluster.slots_freed_for(a, 2) == 1  # evicting a sleeper frees its place, and c fits then
    assert cluster.num_used_slots == 0  # a GPU holding only sleepers is not in use
    with pytest.raises(ValueError, match="only an idle ready instance on a slot host can"):
        cluster.sleep(b)
    cluster.close(500.0)
    assert 60.0 < cluster.accelerator_s < 62.5  # in use until they slept, not until the end


def test_a_waiting_model_evicts_a_sleeper_for_its_place_before_an_idle_instance():
    """a sleeps, b is awake and idle, both places of the GPU taken: c evicts the sleeper (every
    sleeper goes before an awake instance), and b keeps serving."""
    loop, cluster, _ = build([MODEL_A, MODEL_B, MODEL_C], models_per_gpu=2)
    arrive(loop, cluster, 0.0, 0, 0, output_tokens=1)
    arrive(loop, cluster, 0.0, 1, 1, output_tokens=1)
    arrive(loop, cluster, 65.0, 2, 1, output_tokens=1)  # keeps b awake past a's keep-alive
    arrive(loop, cluster, 90.0, 3, 2, output_tokens=1)
    loop.run(until_s=100.0)
    assert cluster.counts["sleeps"] >= 1 and cluster.counts["evictions"] == 1
    assert cluster.ttft_s[3] == pytest.approx(COST.load_s(MODEL_C.weight_bytes, "dram") + prefill_s(MODEL_C), abs=1e-9)
    assert not cluster.models[0].sleepers and not cluster.models[0].instances  # a's sleeper was the one evicted
    assert [i.phase.name for i in cluster.models[1].instances] == ["READY"]


def test_a_sleeper_whose_gpu_has_no_memory_for_it_is_stopped_and_its_model_placed_anew():
    """a and b on GPU 0 (three places, memory for two); a sleeps; c takes the memory a gave back
    there; a's model wanted again cannot wake on GPU 0, so its sleeper is stopped and a new
    instance is loaded on GPU 1 (the controller's rule: placement may then put it anywhere)."""
    loop, cluster, _ = build([MODEL_A, MODEL_B, MODEL_C], gpus=2, models_per_gpu=3)
    arrive(loop, cluster, 0.0, 0, 0, output_tokens=1)
    arrive(loop, cluster, 0.0, 1, 1, output_tokens=1)
    arrive(loop, cluster, 50.0, 2, 1, output_tokens=1)  # b stays awake past a's keep-alive
    arrive(loop, cluster, 70.0, 3, 2, output_tokens=1)
    arrive(loop, cluster, 80.0, 4, 0, output_tokens=1)
    loop.run(until_s=75.0)
    [a] = cluster.models[0].sleepers
    [c] = cluster.models[2].instances
    assert [h.index for h in a.hosts] == [0] and [h.index for h in c.hosts] == [0]  # best fit: beside b
    assert not cluster.hosts.can_wake(a)
    loop.run(until_s=85.0)
    [again] = cluster.models[0].instances
    assert [h.index for h in again.hosts] == [1] and cluster.counts["wakes"] == 0
    assert a.index not in cluster.instances and not cluster.models[0].sleepers
    assert cluster.ttft_s[4] == pytest.approx(COST.load_s(MODEL_A.weight_bytes, "dram") + prefill_s(), abs=1e-9)


def test_the_host_memory_for_sleepers_drops_the_longest_asleep_first():
    """Host memory for one sleeper per node (`controller.room_for_sleeper` decides): b falling
    asleep after a stops a; with less than one model's weights, nothing sleeps."""
    from sim.thaw_sleep import scale_down

    loop, cluster, _ = build([MODEL_A, MODEL_B], models_per_gpu=2, sleep_bytes_per_gpu=MODEL_A.weight_bytes)
    arrive(loop, cluster, 0.0, 0, 0, output_tokens=1)
    arrive(loop, cluster, 0.0, 1, 1, output_tokens=1)
    loop.run(until_s=1.0)  # both loaded, served and idle
    [a], [b] = cluster.models[0].instances, cluster.models[1].instances
    assert scale_down(cluster, a, sleep=True) == "slept"
    assert list(cluster.nodes[0].sleepers.values()) == [a]
    assert scale_down(cluster, b, sleep=True) == "slept"
    assert list(cluster.nodes[0].sleepers.values()) == [b] and a.index not in cluster.instances

    loop, cluster, _ = build([MODEL_A], models_per_gpu=2, sleep_bytes_per_gpu=MODEL_A.weight_bytes - 1)
    arrive(loop, cluster, 0.0, 0, 0, output_tokens=1)
    loop.run(until_s=1.0)
    [a] = cluster.models[0].instances
    assert scale_down(cluster, a, sleep=True) == "stopped" and not cluster.nodes[0].sleepers
