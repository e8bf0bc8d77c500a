"""Reading Hugging Face configs of every supported family, in both config dialects."""

from __future__ import annotations

import json

import pytest
import torch

from worker.model_config import ModelConfig, RopeScaling, UnsupportedModelError
from worker.rotary_embedding import inverse_frequencies

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def test_llama3_rope_in_old_and_new_dialects_agree():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_type": "llama3"}
    old = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **BASE, "rope_theta": 500000.0,
                                    "rope_scaling": scaling})
    new = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **BASE,
                                    "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    assert old == new
    assert old.rope_theta == 500000.0 and old.rope_scaling.rope_type == "llama3"
    assert old.head_dim == 16 and not old.attention_bias


def test_llama3_inverse_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf_config = LlamaConfig(**BASE, rope_parameters=params)
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = inverse_frequencies(16, 500000.0, RopeScaling(**{k: v for k, v in params.items() if k != "rope_theta"}))
    torch.testing.assert_close(ours, hf_inv_freq.float(), rtol=0, atol=0)


def test_qwen2_has_qkv_bias_and_mistral_a_window():
    qwen = ModelConfig.from_hf_dict({"architectures": ["Qwen2ForCausalLM"], **BASE, "use_sliding_window": False,
                                     "sliding_window": 32, "tie_word_embeddings": True})
    assert qwen.attention_bias and qwen.tie_word_embeddings and qwen.sliding_windows == (None, None)
    mistral = ModelConfig.from_hf_dict({"architectures": ["MistralForCausalLM"], **BASE, "sliding_window": 32})
    assert mistral.sliding_windows == (32, 32) and not mistral.attention_bias
    typed = ModelConfig.from_hf_dict({"architectures": ["Qwen2ForCausalLM"], **BASE, "sliding_window": 8,
                                      "layer_types": ["full_attention", "sliding_attention"]})
    assert typed.sliding_windows == (None, 8)


@pytest.mark.parametrize(
    "patch,error,message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, UnsupportedModelError, "GPT2LMHeadModel"),
        ({"architectures": []}, UnsupportedModelError, "names no architecture"),
        ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, UnsupportedModelError, "proportional"),
        ({"hidden_act": "gelu"}, UnsupportedModelError, "gelu"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, UnsupportedModelError,
         r"quantization_config: quantized checkpoints \(fp8\) are not supported"),
        ({"num_key_value_heads": 3}, ValueError, "multiple of"),
    ],
)
def test_unsupported_or_invalid_configs_are_refused_by_name(patch, error, message):
    raw = {"architectures": ["LlamaForCausalLM"], **BASE, **patch}
    with pytest.raises(error, match=message):
        ModelConfig.from_hf_dict(raw)


def test_config_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_model_dir(tmp_path)
    raw = {"architectures": ["LlamaForCausalLM"], **BASE}
    del raw["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_model_dir(tmp_path)


def test_qwen3_normalises_queries_and_keys_and_qwen2_does_not():
    qwen3 = ModelConfig.from_hf_dict({"architectures": ["Qwen3ForCausalLM"], **BASE, "head_dim": 128})
    assert (qwen3.qk_norm, qwen3.attention_bias, qwen3.head_dim) == (True, False, 128)
    qwen2 = ModelConfig.from_hf_dict({"architectures": ["Qwen2ForCausalLM"], **BASE})
    assert (qwen2.qk_norm, qwen2.attention_bias) == (False, True)


def test_mixtral_is_sparse_everywhere_with_renormalised_float32_weights():
    mixtral = ModelConfig.from_hf_dict({"architectures": ["MixtralForCausalLM"], **BASE, "num_local_experts": 8,
                                        "num_experts_per_tok": 2, "sliding_window": 16, "router_jitter_noise": 0.1})
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 128)
    assert (mixtral.norm_topk_prob, mixtral.moe_weights_float32, mixtral.qk_norm) == (True, True, False)
    assert mixtral.moe_layers == (True, True) and mixtral.sliding_windows == (16, 16)
    # attention 2 * (64*(64+2*32) + 64*64 + 2*64); experts 2 * 8 * (3*64*128 + 64); embed + head + norm
    assert mixtral.num_params == 2 * (8192 + 4096 + 128) + 2 * 8 * (24576 + 64) + 2 * 100 * 64 + 64


def test_qwen3_moe_layers_follow_sparse_step_and_mlp_only_layers():
    raw = {"architectures": ["Qwen3MoeForCausalLM"], **BASE, "num_hidden_layers": 6, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3],
           "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4}
    config = ModelConfig.from_hf_dict(raw)
    assert config.moe_layers == (False, True, False, False, False, True)
    assert (config.norm_topk_prob, config.moe_weights_float32, config.qk_norm) == (False, False, True)
    assert (config.intermediate_size, config.moe_intermediate_size) == (128, 32)
    assert config.sliding_windows == (8,) * 6  # transformers' Qwen3-MoE ignores max_window_layers
    # transformers 5 saves num_experts as num_local_experts
    saved = ModelConfig.from_hf_dict({**{k: v for k, v in raw.items() if k != "num_experts"},
                                      "num_local_experts": 4, "norm_topk_prob": True})
    assert saved.num_experts == 4 and saved.norm_topk_prob
    dense = ModelConfig.from_hf_dict({**raw, "num_experts": 0})
    assert dense.moe_layers == (False,) * 6 and dense.num_experts == 0


QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], **BASE, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32}


@pytest.mark.parametrize(
    "patch,error,message",
    [
        ({"shared_expert_intermediate_size": 256}, UnsupportedModelError,
         r"shared_expert_intermediate_size=256: shared experts are not supported"),
        ({"n_shared_experts": 1}, UnsupportedModelError, "n_shared_experts=1: shared experts"),
        ({"num_experts_per_tok": 5}, ValueError, r"num_experts_per_tok must be between 1 and num_experts \(4\), got 5"),
        ({"num_experts_per_tok": 0}, ValueError, "num_experts_per_tok must be between 1"),
        ({"moe_intermediate_size": 0}, ValueError, "moe_intermediate_size must be a positive integer"),
        ({"decoder_sparse_step": 0}, ValueError, "decoder_sparse_step must be a positive integer, got 0"),
        ({"mlp_only_layers": [2]}, ValueError, r"mlp_only_layers names layers \[2\] outside 0..1"),
        ({"num_experts": -1}, ValueError, "num_experts must be a non-negative integer, got -1"),
    ],
)
def test_invalid_moe_configs_are_refused_by_name(patch, error, message):
    with pytest.raises(error, match=message):
        ModelConfig.from_hf_dict({**QWEN3_MOE, **patch})


def test_moe_layers_must_match_the_layer_count_and_experts():
    fields = dict(architecture="Qwen3MoeForCausalLM", head_dim=16, **BASE)
    with pytest.raises(ValueError, match="moe_layers needs one entry per layer: 1 for 2 layers"):
        ModelConfig(**fields, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, moe_layers=(True,))
    with pytest.raises(ValueError, match="moe_layers marks sparse layers but num_experts is 0"):
        ModelConfig(**fields, moe_layers=(True, False))
    assert ModelConfig(**fields).moe_layers == (False, False)


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [float(i + 1) for i in range(8)]}


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 16.0,
         "mscale": 0.707, "mscale_all_dim": 1.0, "attention_factor": 1.5, "truncate": False},
        {**LONGROPE, "original_max_position_embeddings": 128, "attention_factor": 1.1},
        {"rope_type": "dynamic", "factor": 2.0},
    ],
    ids=["yarn", "longrope", "dynamic"],
)
def test_scaled_rope_in_old_and_new_dialects_agree(scaling):
    old_scaling = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
    old = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **BASE, "rope_theta": 500000.0,
                                    "rope_scaling": old_scaling})
    new = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **BASE,
                                    "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    assert old == new and old.rope_theta == 500000.0
    rope = old.rope_scaling
    assert rope.rope_type == scaling["rope_type"] and rope.factor == scaling.get("factor", 512 / 128)
    if rope.rope_type == "yarn":
        assert (rope.original_max_position_embeddings, rope.beta_fast, rope.beta_slow, rope.mscale,
                rope.mscale_all_dim, rope.attention_factor, rope.truncate) == (128, 16.0, 1.0, 0.707, 1.0, 1.5, False)
    if rope.rope_type == "longrope":
        assert rope.short_factor == (1.0,) * 8 and rope.long_factor == tuple(float(i + 1) for i in range(8))
        assert rope.factor == 4.0 and rope.attention_factor == 1.1  # factor: 512 / 128, as transformers derives it
    if rope.rope_type == "dynamic":  # NTK rescales past the config's max_position_embeddings
        assert rope.original_max_position_embeddings == 512


def test_rope_original_length_as_transformers_resolves_it():
    yarn = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}
    raw = {"architectures": ["LlamaForCausalLM"], **BASE, "rope_parameters": yarn}
    assert ModelConfig.from_hf_dict(raw).rope_scaling.factor == 8.0  # 512 / 64
    # A top-level original_max_position_embeddings (Phi-3's place for it) wins over the rope dict's.
    top = ModelConfig.from_hf_dict({**raw, "original_max_position_embeddings": 128}).rope_scaling
    assert top.original_max_position_embeddings == 128 and top.factor == 4.0
    # Neither: max_position_embeddings, for llama3 too.
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling = ModelConfig.from_hf_dict({**raw, "rope_parameters": llama3}).rope_scaling
    assert scaling.original_max_position_embeddings == 512
    nulls = {"rope_type": "yarn", "factor": 4.0, "beta_fast": None, "beta_slow": 0, "truncate": None}
    scaling = ModelConfig.from_hf_dict({**raw, "rope_parameters": nulls}).rope_scaling
    assert (scaling.beta_fast, scaling.beta_slow, scaling.truncate) == (32.0, 1.0, False)


@pytest.mark.parametrize(
    "scaling,error,message",
    [
        ({**LONGROPE, "short_factor": [1.0] * 7}, ValueError,
         r"longrope short_factor must be a list of head_dim / 2 = 8 numbers, got 7 entries"),
        ({**LONGROPE, "long_factor": None}, ValueError, "longrope long_factor must be a list"),
        ({**LONGROPE, "long_factor": [0.0] * 8}, ValueError, "long_factor: a list of numbers > 0"),
        ({"rope_type": "dynamic"}, ValueError, "rope scaling type 'dynamic' needs a factor"),
        ({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0}, ValueError, "attention_factor must be > 0"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -2}, ValueError, "beta_fast must be a number > 0"),
        ({"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}, UnsupportedModelError,
         r"partial_rotary_factor 0.5 \(RoPE over part of each head\) is not supported"),
        ({"rope_type": "mrope", "mrope_section": [2, 3, 3]}, UnsupportedModelError,
         "RoPE scaling type 'mrope' is not supported"),
    ],
)
def test_invalid_rope_parameters_are_refused_by_name(scaling, error, message):
    with pytest.raises(error, match=message):
        ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **BASE, "rope_parameters": scaling})


def test_top_level_partial_rotary_factor_is_refused():
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.75"):
        ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **BASE, "partial_rotary_factor": 0.75})
