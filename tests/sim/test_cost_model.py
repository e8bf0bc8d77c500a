"""The cost model: roofline values computed by hand, tensor-parallel degree, validation."""

import dataclasses

import pytest

from sim.cost_model import A100, H100, CostModel, GpuSpec, default_cost_model
from sim.sim_models import SimModel, architecture_model

LLAMA8 = architecture_model("llama8", "llama-3-8b")
LLAMA70 = architecture_model("llama70", "llama-3-70b")


def test_load_seconds_per_tier():
    cost = default_cost_model()
    assert cost.load_s(16_000_000_000, "dram") == pytest.approx(16e9 / 15.8e9)
    assert cost.load_s(16_000_000_000, "ssd") == pytest.approx(16e9 / 1.52e9)
    assert cost.load_s(16_000_000_000, "remote") == pytest.approx(16e9 / 11.25e9)
    assert cost.load_s(16_000_000_000, "s3") == pytest.approx(16e9 / 0.35e9)
    assert cost.load_s(0, "gpu") == 0.0
    with pytest.raises(ValueError, match=r"unknown load tier 'nvme'; use one of \('gpu', 'dram', 'ssd', 'remote', 's3'\)"):
        cost.load_s(1, "nvme")


def test_decode_step_by_hand_llama8b_on_h100():
    cost = default_cost_model()
    # batch 4, mean context 1000: bytes = 16.06e9 + 4 * 1000 * 131072 = 16.584288e9
    bytes_read = 16.06e9 + 4 * 1000 * 131072
    memory_s = bytes_read / (3.35e12 * 0.90)
    flops = 2 * 8.03e9 * 4 + 4 * 32 * 4096 * 4000  # far below the memory term
    assert flops / (989e12 * 0.5) < memory_s
    expected = memory_s + 2.2e-3 + 4 * 3e-5
    assert cost.decode_step_s(LLAMA8, H100, 4, 1000) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(7.8206e-3, rel=1e-4)  # 5.5006 ms of weights + KV, 2.32 ms fixed


def test_decode_fit_reproduces_its_two_measured_points():
    cost = default_cost_model()
    thaw_engine = SimModel("q", "qwen2", 0.39, 780_000_000, num_layers=24, attention_dim=896, kv_bytes_per_token=12288)
    assert cost.decode_step_s(thaw_engine, H100, 1, 256) == pytest.approx(2.45e-3, rel=0.03)
    a100_40gb = dataclasses.replace(A100, hbm_bytes=40 * 10**9, hbm_bw_Bps=1.555e12)
    assert cost.decode_step_s(LLAMA8, a100_40gb, 1, 1088) == pytest.approx(13.3e-3, rel=0.05)


def test_prefill_by_hand_is_compute_bound():
    cost = default_cost_model()
    flops = 2 * 8.03e9 * 2048 + 2 * 32 * 4096 * 2048 * 2048
    assert cost.prefill_s(LLAMA8, H100, 2048) == pytest.approx(flops / (989e12 * 0.5) + 2.2e-3, rel=1e-12)


def test_tensor_parallel_degree_and_its_costs():
    cost = default_cost_model()
    assert cost.accelerators_needed(LLAMA8, H100) == 1
    assert cost.accelerators_needed(architecture_model("g27", "gemma-2-27b"), H100) == 1  # 54.4 GB <= 64 GB
    assert cost.accelerators_needed(architecture_model("q32", "qwen2.5-32b"), H100) == 2  # 65.0 GB > 80 GB x 0.8
    assert cost.accelerators_needed(LLAMA70, H100) == 4  # 141.2 GB / 2 > 80 GB x 0.8
    step = cost.decode_step_s(LLAMA70, H100, 1, 0)
    assert step == pytest.approx(141.2e9 / 4 / (3.35e12 * 0.9) + 2.2e-3 + 3e-5 + 2 * 80 * 15e-6, rel=1e-12)
    flops = 2 * 70.6e9 * 1000 + 2 * 80 * 8192 * 1000 * 1000
    assert cost.prefill_s(LLAMA70, H100, 1000) == pytest.approx(flops / (989e12 * 0.5) / 4 / 0.745 + 2.2e-3, rel=1e-12)
    huge = SimModel("huge", "x", 400.0, 800 * 10**9)
    with pytest.raises(ValueError, match=r"does not fit 8 x H100-SXM-80GB .* use a larger GPU kind or a smaller model"):
        cost.accelerators_needed(huge, H100)


def test_migration_pause_is_a_multiple_of_the_step():
    cost = default_cost_model()
    step = cost.decode_step_s(LLAMA8, H100, 2, 1500)
    assert cost.migration_pause_s(LLAMA8, H100, 2, 3000, "kv") == pytest.approx(0.61 * step)
    assert cost.migration_pause_s(LLAMA8, H100, 2, 3000, "tokens") == pytest.approx(1.27 * step)
    assert cost.migration_pause_s(LLAMA8, H100, 2, 3000, "restart") == pytest.approx(2 * cost.prefill_s(LLAMA8, H100, 1500))
    assert cost.kv_transfer_s(LLAMA8, 1000) == pytest.approx(1000 * 131072 / 11.25e9)
    with pytest.raises(ValueError, match="unknown migration method 'copy'"):
        cost.migration_pause_s(LLAMA8, H100, 1, 10, "copy")


def test_unknown_shape_uses_llama8b_per_parameter_figures():
    cost = default_cost_model()
    bare = SimModel("bare", "x", 8.03, 16_060_000_000)
    assert cost.decode_step_s(bare, H100, 8, 2000) == pytest.approx(cost.decode_step_s(LLAMA8, H100, 8, 2000))


def test_validation_messages():
    with pytest.raises(ValueError, match=r"CostModel.dram_Bps must be a finite number > 0, got 0"):
        CostModel(dram_Bps=0)
    with pytest.raises(ValueError, match=r"CostModel.prefill_efficiency is a fraction of peak: set it in \(0, 1\]"):
        CostModel(prefill_efficiency=1.5)
    with pytest.raises(ValueError, match="min_kv_fraction .* must be below gpu_memory_utilization"):
        CostModel(min_kv_fraction=0.95)
    with pytest.raises(ValueError, match="kv_pause_factor is the pause as a multiple of a normal decode step"):
        CostModel(kv_pause_factor=0.5)
    with pytest.raises(ValueError, match="GpuSpec X: hbm_bytes must be an int > 0"):
        GpuSpec("X", 0, 1e12, 1e15)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        default_cost_model().decode_step_s(LLAMA8, H100, 0, 10)


@pytest.mark.parametrize("architecture", ["qwen2.5-0.5b", "llama-3-8b", "gemma-2-27b", "qwen2.5-32b", "llama-3-70b"])
@pytest.mark.parametrize("gpu", [H100, A100])
def test_instance_costs_are_the_checked_methods_bit_for_bit(architecture, gpu):
    cost = default_cost_model()
    model = architecture_model("m", architecture)
    fast = cost.instance_costs(model, gpu)
    reference = cost.instance_costs(model, gpu, memoise=False)
    for batch in (1, 2, 7, 64, 227):
        for context in (0.0, 1.5, 100.25, 1234.567, 8191 / 3):
            expected = cost.decode_step_s(model, gpu, batch, context)
            assert fast.decode_step_s(batch, context) == expected  # exact: the same formula, the same order
            assert reference.decode_step_s(batch, context) == expected
    for tokens in (1, 17, 1000, 4097, 32768):
        expected = cost.prefill_s(model, gpu, tokens)
        assert fast.prefill_s(tokens) == expected
        assert fast.prefill_s(tokens) == expected  # the memoised answer
        assert reference.prefill_s(tokens) == expected


def test_the_unmemoised_path_still_checks_its_arguments():
    reference = default_cost_model().instance_costs(LLAMA8, H100, memoise=False)
    with pytest.raises(ValueError, match="batch must be an int >= 1, got 0"):
        reference.decode_step_s(0, 10.0)
    with pytest.raises(ValueError, match="tokens must be an int >= 1, got 0"):
        reference.prefill_s(0)
