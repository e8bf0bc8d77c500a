"""Tiny clusters computed by hand: exact TTFTs from the cost model, and what sets each policy apart.

Each scenario is one node of one or two GPUs and models of 2 GB (1B parameters, bf16), driven
through the real cluster, tick scheduler and policy; expected times are written from the cost
model's own functions, so a change in the cost model does not break them, a change in the
simulator's accounting does.
"""

import pytest

from sim.cost_model import H100, default_cost_model
from sim.event_loop import EventLoop
from sim.policies import PolicySettings, ThawAutoscaling
from sim.policy_factory import make_policy
from sim.cluster_spec import ClusterSpec
from sim.sim_cluster import SimCluster
from sim.sim_models import SimModel
from sim.tick_scheduler import TickScheduler

COST = default_cost_model()
MODEL_A = SimModel(model_id="a", family="llama", params_b=1.0, weight_bytes=2_000_000_000)
MODEL_B = SimModel(model_id="b", family="llama", params_b=1.0, weight_bytes=2_000_000_000)
PROMPT = 100


def build(policy_name, models, *, gpus=1, settings=PolicySettings(), **policy_kwargs):
    loop = EventLoop()
    cluster = SimCluster(ClusterSpec(num_nodes=1, gpus_per_node=gpus, start_overhead_s=0.0), models, COST, H100, loop)
    policy = make_policy(policy_name, settings)
    for name, value in policy_kwargs.items():
        setattr(policy, name, value)
    ticks = TickScheduler(loop, 1.0, policy.tick)
    cluster.attach(policy)
    policy.attach(cluster, ticks)
    return loop, cluster, policy


def arrive(loop, cluster, at_s, index, model_index, output_tokens=10):
    loop.schedule(at_s, cluster.arrive, index, model_index, PROMPT, output_tokens)


def prefill_s(model=MODEL_A):
    return COST.prefill_s(model, H100, PROMPT)


def test_cold_start_from_ssd_then_a_warm_request_exact_ttfts():
    loop, cluster, _ = build("thaw", [MODEL_A])
    cluster.preload(0, 0, "ssd")
    arrive(loop, cluster, 0.0, 0, 0)
    arrive(loop, cluster, 30.0, 1, 0)  # within the 60 s keep-alive of the first one's finish
    loop.run()
    assert cluster.ttft_s[0] == pytest.approx(COST.load_s(MODEL_A.weight_bytes, "ssd") + prefill_s(), abs=1e-9)
    assert cluster.ttft_s[1] == pytest.approx(prefill_s(), abs=1e-9)
    assert cluster.cold_starts == {"gpu": 0, "remote": 0, "dram": 0, "ssd": 1, "s3": 0}
    # The load is kept in DRAM after the start (the SSD copy stays).
    assert cluster.checkpoint_tiers(cluster.nodes[0], 0) == ("dram", "ssd")
    assert not cluster.instances  # scaled to zero after the keep-alive


def test_decode_finishes_after_the_cost_models_steps():
    loop, cluster, _ = build("thaw", [MODEL_A])
    cluster.preload(0, 0, "dram")
    arrive(loop, cluster, 0.0, 0, 0, output_tokens=11)
    loop.run()
    first = COST.load_s(MODEL_A.weight_bytes, "dram") + prefill_s()
    step = COST.decode_step_s(MODEL_A, H100, 1, PROMPT + 11 / 2)
    assert cluster.finish_s[0] == pytest.approx(first + 10 * step, abs=1e-9)


def test_thaw_evicts_an_idle_instance_for_a_waiting_model():
    loop, cluster, policy = build("thaw", [MODEL_A, MODEL_B])
    cluster.preload(0, 1, "dram")  # b can meet its 5 s deadline once loaded from there
    arrive(loop, cluster, 0.0, 0, 0)
    arrive(loop, cluster, 20.0, 1, 1)  # a is idle but within its keep-alive; the only GPU is its
    loop.run()
    assert cluster.counts["evictions"] == 1
    assert cluster.ttft_s[1] == pytest.approx(COST.load_s(MODEL_B.weight_bytes, "dram") + prefill_s(MODEL_B), abs=1e-9)


def test_thaw_evicts_for_a_request_past_saving_only_after_lost_wait_s():
    """b's checkpoint is only in the repository: 2 GB at the S3 rate is more than its 5 s deadline,
    so its request is lost whatever happens; it evicts a's idle instance only once it has waited
    `lost_wait_s` (3 s here), at the first tick after that."""
    from controller import SlotSharingSettings
    from controller.eviction_policy import EvictionSettings

    load_b = COST.load_s(MODEL_B.weight_bytes, "s3")
    assert load_b > 5.0
    loop, cluster, policy = build("thaw", [MODEL_A, MODEL_B],
                                  sharing=SlotSharingSettings(eviction=EvictionSettings(lost_wait_s=3.0)))
    arrive(loop, cluster, 0.0, 0, 0)
    arrive(loop, cluster, 20.5, 1, 1)
    loop.run()
    assert cluster.counts["evictions"] == 1
    assert cluster.ttft_s[1] == pytest.approx(3.5 + load_b + prefill_s(MODEL_B), abs=1e-9)  # evicted at the 24 s tick


def test_serverlessllm_never_evicts_on_demand_the_model_waits_for_the_keep_alive():
    loop, cluster, policy = build("serverlessllm", [MODEL_A, MODEL_B])
    arrive(loop, cluster, 0.0, 0, 0)
    arrive(loop, cluster, 20.0, 1, 1)
    loop.run()
    assert cluster.counts["evictions"] == 0
    a_done = cluster.finish_s[0]
    # b's instance starts at the first tick after a's keep-alive ran out (ticks are whole seconds).
    start_b = a_done + 60.0
    load_b = COST.load_s(MODEL_B.weight_bytes, "s3")
    assert cluster.ttft_s[1] >= start_b - 20.0 + load_b + prefill_s(MODEL_B) - 1e-9
    assert cluster.ttft_s[1] < start_b + 1.0 - 20.0 + load_b + prefill_s(MODEL_B)


def test_thaw_without_slot_sharing_waits_for_the_keep_alive_as_the_controller_does():
    """`slot_sharing=False` is the controller's ``slot_sharing=None``: the same scenario as the
    eviction test above, and b waits until a's keep-alive has run out, then loads from S3."""
    loop = EventLoop()
    cluster = SimCluster(ClusterSpec(num_nodes=1, gpus_per_node=1, start_overhead_s=0.0), [MODEL_A, MODEL_B], COST,
                         H100, loop)
    policy = make_policy("thaw", PolicySettings(), thaw_slot_sharing=False)
    ticks = TickScheduler(loop, 1.0, policy.tick)
    cluster.attach(policy)
    policy.attach(cluster, ticks)
    cluster.preload(0, 1, "dram")  # with sharing on, b would evict a (the eviction test above)
    arrive(loop, cluster, 0.0, 0, 0)
    arrive(loop, cluster, 20.0, 1, 1)
    loop.run()
    assert cluster.counts["evictions"] == 0 and policy.describe()["slot_sharing"] is False
    # a's keep-alive runs out 60 s after its last request finished; the tick after it stops a,
    # the next places b (ticks are whole seconds).
    expires_s = cluster.finish_s[0] + policy.autoscaling.keep_alive_s
    load_b = COST.load_s(MODEL_B.weight_bytes, "dram")
    assert expires_s - 20.0 + load_b + prefill_s(MODEL_B) - 1e-9 <= cluster.ttft_s[1] \
        < expires_s + 2.0 - 20.0 + load_b + prefill_s(MODEL_B)
    with pytest.raises(ValueError, match="give sharing settings or slot_sharing=False, not both"):
        from controller import SlotSharingSettings
        make_policy("thaw", PolicySettings(), thaw_sharing=SlotSharingSettings(), thaw_slot_sharing=False)


@pytest.mark.parametrize("timeout_s", [None, 30.0])
def test_a_request_no_instance_takes_within_the_queue_timeout_fails_and_is_never_served(timeout_s):
    """The ServerlessLLM scenario above: b's request waits for a's keep-alive (~60 s past a's
    finish). With the gateway's 30 s queue timeout it fails at 50 s instead: it leaves the queue,
    is never served, and b is never started for it."""
    loop = EventLoop()
    cluster = SimCluster(ClusterSpec(num_nodes=1, gpus_per_node=1, start_overhead_s=0.0, queue_timeout_s=timeout_s),
                         [MODEL_A, MODEL_B], COST, H100, loop)
    policy = make_policy("serverlessllm", PolicySettings())
    ticks = TickScheduler(loop, 1.0, policy.tick)
    cluster.attach(policy)
    policy.attach(cluster, ticks)
    arrive(loop, cluster, 0.0, 0, 0)
    arrive(loop, cluster, 20.0, 1, 1)
    loop.run()
    if timeout_s is None:
        assert cluster.counts["requests_timed_out"] == 0 and cluster.ttft_s[1] > 40.0
        assert cluster.cold_starts["s3"] == 2
    else:
        assert cluster.counts["requests_timed_out"] == 1 and cluster.ttft_s[1] != cluster.ttft_s[1]  # NaN
        assert cluster.cold_starts["s3"] == 1 and cluster.num_done == 2 and cluster.num_finished == 1
    assert cluster.ttft_s[0] == pytest.approx(COST.load_s(MODEL_A.weight_bytes, "s3") + prefill_s(), abs=1e-9)
    with pytest.raises(ValueError, match="ClusterSpec.queue_timeout_s must be a finite number > 0 or None"):
        ClusterSpec(num_nodes=1, gpus_per_node=1, queue_timeout_s=0)


def test_serverlessllm_loads_from_the_fastest_tier_on_the_node():
    loop, cluster, _ = build("serverlessllm", [MODEL_A])
    cluster.preload(0, 0, "dram")
    arrive(loop, cluster, 0.0, 0, 0)
    loop.run()
    assert cluster.cold_starts["dram"] == 1
    assert cluster.ttft_s[0] == pytest.approx(COST.load_s(MODEL_A.weight_bytes, "dram") + prefill_s(), abs=1e-9)


def test_rayserve_loads_from_s3_even_with_a_node_copy_and_waits_its_upscale_delay():
    settings = PolicySettings(target_ongoing_requests=1.0)
    loop, cluster, policy = build("rayserve", [MODEL_A], gpus=2, settings=settings)
    cluster.preload(0, 0, "dram")
    arrive(loop, cluster, 0.0, 0, 0, output_tokens=40_000)  # long requests keep the demand at 2
    arrive(loop, cluster, 20.0, 1, 0, output_tokens=40_000)
    loop.run(until_s=50.5)
    assert sorted(i.started_s for i in cluster.instances.values()) == [0.0]  # from zero: at once
    loop.run(until_s=60.0)
    # The second request was routed to the ready replica (no queue, no wake): the next grid tick,
    # t=21, saw the wish for a second replica, which had to hold upscale_delay_s = 30.
    assert sorted(i.started_s for i in cluster.instances.values()) == [0.0, 51.0]
    assert cluster.cold_starts["s3"] == 2 and cluster.cold_starts["dram"] == 0
    loop.run()  # a TTFT is recorded when its request finishes (a suspension could still undo it)
    assert cluster.ttft_s[0] == pytest.approx(COST.load_s(MODEL_A.weight_bytes, "s3") + prefill_s(), abs=1e-9)


def test_unbounded_serves_every_request_at_its_prefill():
    loop, cluster, _ = build("unbounded", [MODEL_A, MODEL_B])
    for i in range(4):
        arrive(loop, cluster, 5.0 * i, i, i % 2)
    loop.run()
    assert list(cluster.ttft_s) == pytest.approx([prefill_s()] * 4, abs=1e-12)
    assert sum(cluster.cold_starts.values()) == 0
    step = COST.decode_step_s(MODEL_A, H100, 1, PROMPT + 10 / 2)
    assert cluster.accelerator_s == pytest.approx(4 * (prefill_s() + 9 * step), abs=1e-9)


def test_an_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="thaw, serverlessllm, rayserve, unbounded"):
        make_policy("knative", PolicySettings())


def test_thaw_keeps_an_instance_idle_less_than_its_min_idle_s():
    from controller import SlotSharingSettings
    from controller.eviction_policy import EvictionSettings

    loop, cluster, policy = build("thaw", [MODEL_A, MODEL_B],
                                  sharing=SlotSharingSettings(eviction=EvictionSettings(min_idle_s=120.0)))
    arrive(loop, cluster, 0.0, 0, 0)
    arrive(loop, cluster, 20.0, 1, 1)  # a is idle ~14 s: evictable by default (0.5 s), not under 120 s
    loop.run()
    assert cluster.counts["evictions"] == 0 and cluster.counts["preemptions"] == 0
    # b starts once a's keep-alive (60 s after its finish) has scaled it to zero: within two grid
    # ticks (the tick at the keep-alive takes the waiting b first, as the controller orders them,
    # then scales a down; b tries again next tick).
    start_b = cluster.finish_s[0] + 60.0
    load_b = COST.load_s(MODEL_B.weight_bytes, "s3")
    assert cluster.ttft_s[1] >= start_b - 20.0 + load_b + prefill_s(MODEL_B) - 1e-9
    assert cluster.ttft_s[1] < start_b + 2.0 - 20.0 + load_b + prefill_s(MODEL_B)


@pytest.mark.parametrize("preempt", [True, False])
def test_thaw_preempts_a_busy_instance_only_when_allowed(preempt):
    from controller import SlotSharingSettings

    loop, cluster, policy = build("thaw", [MODEL_A, MODEL_B],
                                  sharing=SlotSharingSettings(preempt=preempt, deadline_preemption=False))
    arrive(loop, cluster, 0.0, 0, 0, output_tokens=200_000)  # a is busy for minutes
    arrive(loop, cluster, 10.0, 1, 1)  # b waits for the only GPU: 5 s (its bounded wait), then preempts
    loop.run(until_s=16.0)
    assert cluster.counts["evictions"] == 0
    assert cluster.counts["preemptions"] == (1 if preempt else 0)
    assert [cluster.models[i.model_index].model_id for i in cluster.instances.values()] == (["b"] if preempt else ["a"])
    assert policy.describe()["preempt"] is preempt


@pytest.mark.parametrize("reclaim", [True, False])
def test_thaw_reclaims_a_slot_by_migrating_to_a_sibling_when_no_node_has_room(reclaim):
    loop, cluster, policy = build("thaw", [MODEL_A, MODEL_B], gpus=2, settings=PolicySettings(target_ongoing_requests=1))
    if not reclaim:
        policy.reclaim_costs = None  # the controller's slot_reclaim=None
    for i in range(2):  # a wants two instances and gets both GPUs; its requests are long
        arrive(loop, cluster, 0.0, i, 0, output_tokens=200_000)
    loop.run(until_s=50.0)
    assert len(cluster.models[0].ready_instances()) == 2
    arrive(loop, cluster, 50.0, 2, 0, output_tokens=200_000)  # to the instance the first two left idle
    arrive(loop, cluster, 60.0, 3, 1)  # b waits: no free GPU, nothing idle to evict, 5 s before it may preempt
    loop.run(until_s=63.0)
    a_instances = [i for i in cluster.instances.values() if i.model_index == 0]
    assert cluster.counts["evictions"] == 0 and cluster.counts["preemptions"] == 0
    assert policy.counts()["slot_reclaims"] == (1 if reclaim else 0)
    assert policy.describe()["slot_reclaim"] is reclaim
    if reclaim:  # the instance with one request emptied into its sibling; b loads in its slot
        assert cluster.counts["migrations"] == 1 and cluster.counts["requests_migrated"] == 1
        assert [i.num_ongoing for i in a_instances] == [3]
        assert [cluster.models[i.model_index].model_id for i in cluster.instances.values()] == ["a", "b"]
    else:
        assert cluster.counts["migrations"] == 0 and sorted(i.num_ongoing for i in a_instances) == [1, 2]


def test_a_request_migrated_mid_prefill_is_prefilled_again_and_gets_its_first_token():
    loop = EventLoop()
    long_prompt = 200_000  # its prefill outlasts the migration's pause
    cluster = SimCluster(ClusterSpec(num_nodes=1, gpus_per_node=2), [MODEL_A], COST, H100, loop)
    cluster.attach(_Inert())
    source = cluster.start_instance(0, 0, "dram")
    destination = cluster.start_instance(0, 0, "dram")
    loop.run(until_s=1.0)  # both loaded
    prefill = COST.prefill_s(MODEL_A, H100, long_prompt)
    pause = COST.migration_pause_s(MODEL_A, H100, 1, long_prompt, "kv")
    loop.schedule(1.0, cluster.arrive, 0, 0, long_prompt, 5)
    loop.run(until_s=1.0 + prefill - pause / 2)  # its prefill ends during the pause
    [holder] = [i for i in (source, destination) if i.num_ongoing]
    other = destination if holder is source else source
    cluster.migrate(holder, other, token_based=False)  # by KV, just before its first token
    loop.run()
    # It lands after its prefill would have ended, but its first token never came out: prefilled again.
    assert cluster.ttft_s[0] == pytest.approx(1.0 + prefill - pause / 2 + pause + prefill - 1.0, abs=1e-6)
    assert cluster.finish_s[0] > cluster.ttft_s[0]


class _Inert:
    """A policy that decides nothing (the cluster's own mechanics alone)."""

    keeps_node_copies = True

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_requests_migrated_past_the_destinations_batch_wait_in_the_queue():
    loop = EventLoop()
    cluster = SimCluster(ClusterSpec(num_nodes=1, gpus_per_node=2, max_batch=2), [MODEL_A], COST, H100, loop)
    cluster.attach(_Inert())
    source = cluster.start_instance(0, 0, "dram")
    destination = cluster.start_instance(0, 0, "dram")
    for i in range(4):  # two each, alternately (least loaded first): 0 and 2 on the source
        arrive(loop, cluster, 1.0, i, 0, output_tokens=100_000)
    loop.run(until_s=2.0)
    assert (source.num_ongoing, destination.num_ongoing) == (2, 2)
    cluster.migrate(source, destination, token_based=False)
    loop.run(until_s=3.0)  # past the pause: the destination's batch is full
    state = cluster.models[0]
    assert destination.num_ongoing == 2 and [f.index for f in state.queue] == [0, 2]
    assert state.num_ongoing == 2 and cluster.counts["requests_migrated"] == 2


def test_a_models_oldest_wait_is_the_longest_any_queued_request_waited():
    from sim.sim_model_state import SimModelState
    from sim.sim_instance import Flight

    state = SimModelState(0, MODEL_A, 1, None)
    assert state.oldest_wait_s(50.0) == 0.0
    state.queue.extend([Flight(0, 0, 10.0, PROMPT, 5), Flight(1, 0, 20.0, PROMPT, 5)])
    assert state.oldest_wait_s(50.0) == 40.0
    suspended = Flight(2, 0, 5.0, PROMPT, 5)
    suspended.queued_s, suspended.requeued = 45.0, True  # back at the head: it waits from 45 s, as a new ticket
    state.queue.appendleft(suspended)
    assert state.oldest_wait_s(50.0) == 40.0  # not 5 s: the request behind it has waited since 10 s


def test_thaw_keeps_an_idle_model_for_its_keep_alive_per_restart():
    """With the spec's `keep_alive_per_restart` (20 here), a model that restarts in 0.13 s is
    stopped at the 10 s floor and one that restarts in 3.8 s after 76 s idle; the fixed
    keep-alive (60 s) would hold both alike."""
    big = SimModel(model_id="big", family="llama", params_b=30.0, weight_bytes=60_000_000_000)
    policy = make_policy("thaw", PolicySettings(), thaw_spec=ThawAutoscaling(keep_alive_per_restart=20.0))
    loop = EventLoop()
    cluster = SimCluster(ClusterSpec(num_nodes=1, gpus_per_node=2, start_overhead_s=0.0), [MODEL_A, big], COST, H100,
                         loop)
    cluster.attach(policy)
    policy.attach(cluster, TickScheduler(loop, 1.0, policy.tick))
    released: dict[str, float] = {}
    original = policy.on_released

    def on_released(instance):
        released[cluster.models[instance.model_index].model_id] = loop.now
        original(instance)

    policy.on_released = on_released
    for model_index in (0, 1):
        cluster.preload(0, model_index, "dram")
        arrive(loop, cluster, 0.0, model_index, model_index)
    loop.run()
    restart = {m.model_id: m.weight_bytes / COST.dram_Bps for m in (MODEL_A, big)}
    keep = {"a": 10.0, "big": 20.0 * restart["big"]}
    assert restart["a"] * 20 < 10.0 < 60.0 < keep["big"] < 180.0  # the fixed 60 s lies between
    for model_index, model_id in enumerate(("a", "big")):
        idle_from = cluster.finish_s[model_index]
        # Stopped at the first whole-second tick at or after the keep-alive ran out.
        assert idle_from + keep[model_id] - 1e-9 <= released[model_id] < idle_from + keep[model_id] + 1.0 + 1e-9
    assert policy.describe()["keep_alive_per_restart"] == 20.0


@pytest.mark.parametrize("tier, preempted", [("dram", True), ("s3", False)])
def test_thaw_preempts_an_equal_priority_only_to_save_a_deadline(tier, preempted):
    """The default (`deadline_preemption`): past b's 5 s bound its request has waited 5 s of its 5 s
    deadline, so no load can save it; b's next request, 1 s old at the next tick, can still be
    saved from DRAM (well under its 4 s left), so a is preempted then, but not from S3 (longer)."""
    loop, cluster, policy = build("thaw", [MODEL_A, MODEL_B])
    if tier == "dram":
        cluster.preload(0, 1, "dram")
    load_s = COST.load_s(MODEL_B.weight_bytes, tier)
    assert (load_s < 3.0) is preempted  # the premise
    arrive(loop, cluster, 0.0, 0, 0, output_tokens=200_000)  # a is busy for minutes
    arrive(loop, cluster, 10.0, 1, 1)
    loop.run(until_s=15.5)  # past the bound: the first request alone, its deadline gone
    assert cluster.counts["preemptions"] == 0
    arrive(loop, cluster, 15.5, 2, 1)  # a fresh one
    loop.run(until_s=20.0)
    assert cluster.counts["preemptions"] == (1 if preempted else 0)
    if preempted:
        assert cluster.ttft_s[2] <= 5.0  # the fresh request's first token within its deadline
    assert policy.describe()["deadline_preemption"] is True
