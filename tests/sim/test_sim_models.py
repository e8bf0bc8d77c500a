"""The model catalog: seeded, sizes from the listed architectures, validated."""

import pytest

from sim.sim_models import ARCHITECTURES, SIZE_MIX, SimModel, architecture_model, model_catalog


def test_catalog_is_deterministic_under_a_seed_and_follows_the_mix():
    a, b = model_catalog(2000, seed=7), model_catalog(2000, seed=7)
    assert a == b
    assert a != model_catalog(2000, seed=8)
    assert [m.model_id for m in a[:2]] == [f"m00000-{a[0].model_id.split('-', 1)[1]}", a[1].model_id]
    small = sum(m.params_b <= 4 for m in a) / len(a)
    big = sum(m.params_b >= 70 for m in a) / len(a)
    assert abs(small - 0.53) < 0.04 and abs(big - 0.05) < 0.02
    assert abs(sum(SIZE_MIX.values()) - 1) < 1e-12 and set(SIZE_MIX) == set(ARCHITECTURES)


def test_architecture_shapes_are_the_config_values():
    llama = architecture_model("x", "llama-3-8b")
    assert (llama.family, llama.weight_bytes, llama.num_layers, llama.attention_dim) == ("llama-3", 16_060_000_000, 32, 4096)
    assert llama.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert architecture_model("y", "qwen2.5-0.5b").kv_bytes_per_token == 12288


def test_validation_messages():
    with pytest.raises(ValueError, match="params_b must be a number > 0"):
        SimModel("m", "f", 0.0, 10)
    with pytest.raises(ValueError, match="weight_bytes must be an int > 0"):
        SimModel("m", "f", 1.0, 0)
    with pytest.raises(ValueError, match="num_models must be an int >= 1"):
        model_catalog(0, 1)
    with pytest.raises(ValueError, match="unknown architecture 'gpt-9'"):
        architecture_model("m", "gpt-9")
