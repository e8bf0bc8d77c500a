"""Replaying a real run: a measured `HardwareProfile`, an explicit request list and Thaw's policy
with the deployed spec give TTFTs computed by hand (spare workers taken, recycled, refilled; DRAM
promoted once the node settles; a stopped instance's slot held for the model it was freed for),
and the same replay twice gives the same run."""

import dataclasses

import numpy as np
import pytest

from controller import AutoscalingPolicy, SlotSharingSettings
from sim import HardwareProfile, ModelTiming, SimConfig, SimRequest, explicit_workload, run_simulation

MB = 1_000_000
PREFILL_S = 0.02 + 10 * 0.001  # a 10-token prompt
OVERHEAD_S = 0.01


def timing(model_id: str) -> ModelTiming:
    return ModelTiming(model_id=model_id, weight_bytes=MB, prefill_s=0.02, prefill_s_per_token=0.001,
                       decode_step_s=0.005)


NODE = HardwareProfile(name="one-slot", num_slots=1, dram_bytes=1 << 30, ssd_bytes=1 << 30, dram_Bps=10e9,
                       ssd_Bps=2e9, repository_Bps=1e9, peer_Bps=1e9, spare_start_s=0.5, process_start_s=2.0,
                       spare_workers=1, spare_warm_s=3.0, settle_s=5.0, request_overhead_s=OVERHEAD_S, stop_s=0.1,
                       recycle_s=0.3, models=(timing("a"), timing("b"), timing("c")))
SPEC = AutoscalingPolicy(min_instances=0, max_instances=1, upscale_delay_s=0.0, downscale_delay_s=0.0,
                         keep_alive_s=30.0)
REQUESTS = [SimRequest(0.0, "a", 10, 4), SimRequest(2.0, "b", 10, 4), SimRequest(10.0, "c", 10, 4),
            SimRequest(20.0, "a", 10, 4)]


def replay(profile=NODE, requests=REQUESTS):
    config = SimConfig(num_models=len(profile.models), num_nodes=1, hours=30 / 3600, policy="thaw", tick_s=1.0,
                       thaw_sharing=SlotSharingSettings(), thaw_autoscaling=SPEC, real_controller_timing=True,
                       hardware=profile, sample_s=1.0)
    return run_simulation(config, requests=explicit_workload(requests, [m.model_id for m in profile.models]))


def test_replay_by_hand_spares_taken_recycled_and_refilled():
    result = replay()
    expected = [
        # a: placed at its arrival, on the warm spare, read from the repository.
        1e-3 + 0.5 + PREFILL_S + OVERHEAD_S,
        # b: a (idle since the tick after its last token, t=1) is evicted at 2.0; its worker goes back
        # to the pool, the slot held for b is free 0.3 s later, and b takes that spare.
        0.3 + 1e-3 + 0.5 + PREFILL_S + OVERHEAD_S,
        # c: the node settled at 7.801 (b ready 5 s) and started a new spare (warm at 10.801); b is
        # evicted at 10.0 but the pool has no room for its worker (ended: the slot free 0.1 s later),
        # and c finds no warm spare: a new process.
        0.1 + 1e-3 + 0.5 + 2.0 + PREFILL_S + OVERHEAD_S,
        # a again: promoted into DRAM at 7.801 (evicted before the node settled); c is ended at 20.0,
        # a reads DRAM on the spare that warmed at 10.801.
        0.1 + 1e-4 + 0.5 + PREFILL_S + OVERHEAD_S,
    ]
    np.testing.assert_allclose(result.ttft_s, expected, rtol=0, atol=1e-9)
    assert result.cold_starts_by_tier == {"gpu": 0, "remote": 0, "dram": 1, "ssd": 0, "s3": 3}
    assert result.evictions == 3 and result.preemptions == 0
    # Spares started: at 7.801, and at 25.6001 (the node settled after a's second start took the last).
    assert {k: result.counts[k] for k in ("starts_from_spare", "spares_started", "spares_recycled",
                                          "dram_promotions")} == \
        {"starts_from_spare": 3, "spares_started": 2, "spares_recycled": 1, "dram_promotions": 3}


def test_without_spares_every_start_is_a_new_process():
    result = replay(profile=dataclasses.replace(NODE, spare_workers=0))
    assert result.ttft_s[0] == pytest.approx(1e-3 + 0.5 + 2.0 + PREFILL_S + OVERHEAD_S, abs=1e-9)
    assert result.counts["starts_from_spare"] == 0 and result.counts["spares_started"] == 0


def test_the_same_replay_twice_gives_the_same_run():
    requests = [SimRequest(0.25 * i, "abc"[i % 3], 5 + i % 7, 1 + i % 5) for i in range(60)]
    first, second = replay(requests=requests), replay(requests=requests)
    assert first.num_requests == second.num_requests == 60 == first.num_served
    np.testing.assert_array_equal(first.ttft_s, second.ttft_s)
    timeless = ("wall_s", "cpu_s", "decision_ms_p50", "decision_ms_p99")
    assert {k: v for k, v in first.summary().items() if k not in timeless} == \
        {k: v for k, v in second.summary().items() if k not in timeless}


def test_config_takes_the_profile_and_the_spec_or_says_why_not():
    with pytest.raises(ValueError, match=r"SimConfig.num_models \(2\) must be the hardware profile's model count \(3\)"):
        SimConfig(num_models=2, num_nodes=1, hardware=NODE)
    with pytest.raises(ValueError, match="SimConfig.hardware must be a HardwareProfile or None, got str"):
        SimConfig(num_models=3, num_nodes=1, hardware="cpu")
    with pytest.raises(ValueError, match="SimConfig.thaw_autoscaling must be a controller AutoscalingPolicy"):
        SimConfig(num_models=3, num_nodes=1, thaw_autoscaling={"keep_alive_s": 30})
    with pytest.raises(ValueError, match="give thaw_max_wait_before_preempt_s or thaw_autoscaling"):
        SimConfig(num_models=3, num_nodes=1, thaw_autoscaling=SPEC, thaw_max_wait_before_preempt_s=1.0)
    with pytest.raises(ValueError, match="SimConfig.real_controller_timing must be True or False, got 1"):
        SimConfig(num_models=3, num_nodes=1, real_controller_timing=1)


@pytest.mark.parametrize("field, value, message", [
    ("spare_workers_per_node", -1, "ClusterSpec.spare_workers_per_node must be an integer >= 0, got -1"),
    ("process_start_s", float("inf"), "ClusterSpec.process_start_s must be a finite number >= 0, got inf"),
    ("stop_s", -0.1, "ClusterSpec.stop_s must be a finite number >= 0, got -0.1"),
    ("promote_on_settle", 1, "ClusterSpec.promote_on_settle must be True or False, got 1"),
])
def test_cluster_spec_refuses_bad_node_upkeep_fields(field, value, message):
    from sim.cluster_spec import ClusterSpec

    with pytest.raises(ValueError) as raised:
        ClusterSpec(num_nodes=1, gpus_per_node=1, **{field: value})
    assert str(raised.value) == message
