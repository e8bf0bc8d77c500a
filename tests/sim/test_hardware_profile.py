"""A measured node: `HardwareProfile` / `ModelTiming` validate every field with a message that says
what to change, and `ProfileCostModel` answers the cluster's questions from the measurements alone."""

import dataclasses
import re

import pytest

from sim import HardwareProfile, ModelTiming, ProfileCostModel
from sim.sim_models import SimModel

TINY = ModelTiming(model_id="bench/m0-tiny", weight_bytes=25_000_000, prefill_s=0.02, prefill_s_per_token=0.001,
                   decode_step_s=0.01, decode_s_per_sequence=0.002)
MEDIUM = ModelTiming(model_id="bench/m2-medium", weight_bytes=185_000_000, prefill_s=0.05,
                     prefill_s_per_token=0.004, decode_step_s=0.04)
CPU_NODE = HardwareProfile(name="cpu-node", num_slots=2, dram_bytes=4 << 30, ssd_bytes=16 << 30, dram_Bps=8e9,
                           ssd_Bps=2e9, repository_Bps=5e8, peer_Bps=1.5e9, spare_start_s=0.3, process_start_s=2.5,
                           spare_workers=1, spare_warm_s=4.0, settle_s=5.0, request_overhead_s=0.015, stop_s=0.05,
                           recycle_s=0.4, max_batch=64, models=(TINY, MEDIUM))


def test_model_timing_gives_prefill_and_decode_times():
    assert TINY.prefill_time_s(10) == pytest.approx(0.02 + 10 * 0.001)
    assert TINY.decode_time_s(1) == 0.01
    assert TINY.decode_time_s(4) == pytest.approx(0.01 + 3 * 0.002)


@pytest.mark.parametrize("change, message", [
    ({"model_id": ""}, "ModelTiming.model_id must be a non-empty string, got ''"),
    ({"weight_bytes": 0}, "ModelTiming bench/m0-tiny.weight_bytes must be an integer >= 1, got 0"),
    ({"weight_bytes": 2.5e7}, "ModelTiming bench/m0-tiny.weight_bytes must be an integer >= 1, got 25000000.0"),
    ({"prefill_s": -0.1}, "ModelTiming bench/m0-tiny.prefill_s must be a finite number >= 0, got -0.1"),
    ({"prefill_s_per_token": float("nan")}, "ModelTiming bench/m0-tiny.prefill_s_per_token must be a finite number"),
    ({"decode_step_s": 0.0}, "ModelTiming bench/m0-tiny.decode_step_s must be a finite number > 0, got 0.0"),
    ({"decode_s_per_sequence": True}, "ModelTiming bench/m0-tiny.decode_s_per_sequence must be a finite number"),
    ({"prefill_s": 0.0, "prefill_s_per_token": 0.0}, "a one-token prefill would take no time"),
])
def test_model_timing_refuses_bad_fields(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(TINY, **change)


@pytest.mark.parametrize("change, message", [
    ({"name": ""}, "HardwareProfile.name must be a non-empty string, got ''"),
    ({"num_slots": 0}, "HardwareProfile cpu-node.num_slots must be an integer >= 1, got 0"),
    ({"dram_bytes": -1}, "HardwareProfile cpu-node.dram_bytes must be an integer >= 0, got -1"),
    ({"spare_workers": 1.0}, "HardwareProfile cpu-node.spare_workers must be an integer >= 0, got 1.0"),
    ({"max_batch": 0}, "HardwareProfile cpu-node.max_batch must be an integer >= 1, got 0"),
    ({"ssd_Bps": 0}, "HardwareProfile cpu-node.ssd_Bps must be a finite number > 0, got 0"),
    ({"repository_Bps": float("inf")}, "HardwareProfile cpu-node.repository_Bps must be a finite number > 0"),
    ({"process_start_s": -2.5}, "HardwareProfile cpu-node.process_start_s must be a finite number >= 0, got -2.5"),
    ({"recycle_s": None}, "HardwareProfile cpu-node.recycle_s must be a finite number >= 0, got None"),
    ({"models": ()}, "HardwareProfile cpu-node: models must be a non-empty sequence of ModelTiming"),
    ({"models": (TINY, "bench/m2-medium")}, "HardwareProfile cpu-node: models must be a non-empty sequence"),
    ({"models": (TINY, TINY)}, "HardwareProfile cpu-node: model ids must be unique, got ['bench/m0-tiny', 'bench/m0-tiny']"),
])
def test_hardware_profile_refuses_bad_fields(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(CPU_NODE, **change)


def test_profile_gives_the_catalog_the_node_and_the_timing_of_each_model():
    assert CPU_NODE.models == (TINY, MEDIUM)  # a list given is kept as a tuple
    assert dataclasses.replace(CPU_NODE, models=[TINY, MEDIUM]).models == (TINY, MEDIUM)
    assert CPU_NODE.timing("bench/m2-medium") is MEDIUM
    with pytest.raises(ValueError, match=r"HardwareProfile cpu-node has no timing for model 'nope'; "
                                         r"it has \['bench/m0-tiny', 'bench/m2-medium'\]"):
        CPU_NODE.timing("nope")
    assert CPU_NODE.sim_models() == [
        SimModel(model_id="bench/m0-tiny", family="measured", params_b=0.0125, weight_bytes=25_000_000),
        SimModel(model_id="bench/m2-medium", family="measured", params_b=0.0925, weight_bytes=185_000_000)]
    spec = CPU_NODE.cluster_spec(num_nodes=3)
    assert (spec.num_nodes, spec.gpus_per_node, spec.dram_bytes_per_node, spec.ssd_bytes_per_node) == \
        (3, 2, 4 << 30, 16 << 30)
    assert (spec.start_overhead_s, spec.process_start_s, spec.spare_workers_per_node, spec.spare_warm_s) == \
        (0.3, 2.5, 1, 4.0)
    assert (spec.settle_s, spec.promote_on_settle, spec.request_overhead_s, spec.stop_s, spec.recycle_s) == \
        (5.0, True, 0.015, 0.05, 0.4)
    assert spec.max_batch == 64


def test_profile_cost_model_answers_from_the_measurements():
    cost = ProfileCostModel(CPU_NODE)
    assert isinstance(cost, ProfileCostModel) and cost.engine_start_s == 0.3
    tiny, medium = CPU_NODE.sim_models()
    assert cost.load_s(185_000_000, "dram") == 185_000_000 / 8e9
    assert cost.load_s(185_000_000, "ssd") == 185_000_000 / 2e9
    assert cost.load_s(185_000_000, "s3") == 185_000_000 / 5e8
    assert cost.load_s(185_000_000, "remote") == 185_000_000 / 1.5e9
    with pytest.raises(ValueError, match="unknown load tier 'nvme'"):
        cost.load_s(1, "nvme")
    with pytest.raises(ValueError, match="weight_bytes must be a finite number >= 0, got -1"):
        cost.load_s(-1, "ssd")
    assert cost.accelerators_needed(medium) == 1
    with pytest.raises(ValueError, match="has no timing for model 'other'"):
        cost.accelerators_needed(SimModel(model_id="other", family="x", params_b=1.0, weight_bytes=2))
    costs = cost.instance_costs(tiny)
    assert costs.prefill_s(10) == pytest.approx(0.03)
    assert costs.decode_step_s(4, 1000.0) == pytest.approx(0.016)  # the context does not enter a measured step
    assert cost.prefill_s(tiny, None, 10) == costs.prefill_s(10)
    assert cost.decode_step_s(tiny, None, 4, 0.0) == costs.decode_step_s(4, 0.0)
    assert cost.migration_pause_s(tiny, None, 1, 20, "kv") == pytest.approx(0.61 * 0.01)
    assert cost.migration_pause_s(tiny, None, 2, 20, "restart") == pytest.approx(2 * (0.02 + 10 * 0.001))
    with pytest.raises(ValueError, match="unknown migration method 'teleport'"):
        cost.migration_pause_s(tiny, None, 1, 20, "teleport")
    with pytest.raises(ValueError, match="ProfileCostModel needs a HardwareProfile, got dict"):
        ProfileCostModel({})
